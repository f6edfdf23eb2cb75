"""Measured tuning: `llmpipe tune buckets CONFIG` sweeps DDP's gradient bucket size.

For each bucket_cap_mb value the run's layout trains a few steps under torchrun, with the profiler on
steps in the middle (not the first, where DDP builds and then rebuilds its buckets, nor the last, which
saves a checkpoint), into a scratch folder `artifacts/<run>/tune/buckets-<value>[-r<k>]/`. Rank 0's breakdown
(llmpipe.train.profile) gives tokens/s and the communication the step waits for (exposed); the
folders (traces, logs, metrics; the checkpoint removed) stay until the next sweep. Beside each
row: the planner's gradient-sync estimate for that bucket size, as `llmpipe plan` computes it (volume at
the bandwidth plus one latency per bucket). The data come from the run's prepare_data stage, run or
reused through the stage machinery; the train stage's folder and checkpoints are never touched.

`--write` sets the winner in the config file (llmpipe.tools.tune_write).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from llmpipe import config as config_mod
from llmpipe.config import ConfigError, RunConfig
from llmpipe.errors import UserError

log = logging.getLogger("llmpipe.tune")

MIN_STEPS = 4  # skipped, warm-up, recorded, last (checkpoint): one each


class TuneError(UserError, RuntimeError):
    """A sweep that could not finish or a result that could not be written; one line."""


@dataclass(frozen=True)
class Point:
    """One measured bucket size (rank 0's profiled steps) and the planner's estimate for it."""

    bucket_cap_mb: float
    tokens_per_s: float  # tokens of the profiled steps / their time
    comm_ms: float  # exposed communication per step (mean)
    overlapped_ms: float  # communication on other threads (DDP's bucket all-reduces during backward), per step
    step_ms: float  # mean step time
    plan_ms: float  # the planner's gradient sync per step: volume at the bandwidth + buckets x latency
    buckets: int  # the planner's collectives per step
    folders: tuple[Path, ...]  # one per run (--repeats)
    spread: float = 0.0  # max / min - 1 of the runs' tokens/s (0 with one run)


# -- input --------------------------------------------------------------------------------------------

def parse_values(text: str) -> list[float]:
    """"1,5,10" -> [1.0, 5.0, 10.0]: positive, finite, in the order given, repeats dropped."""
    values: list[float] = []
    for item in text.split(","):
        try:
            v = float(item)
        except ValueError:
            raise ConfigError(f"--values {text!r}: {item.strip()!r} is not a number (MB, comma-separated, "
                              "e.g. 1,5,25)") from None
        if not (math.isfinite(v) and v > 0):
            raise ConfigError(f"--values {text!r}: bucket_cap_mb must be a positive number of MB (got {item.strip()})")
        if v not in values:
            values.append(v)
    return values


def check_layout(cfg: RunConfig) -> None:
    """Refuse, in one line, a layout whose gradient sync has no bucket_cap_mb to tune."""
    t, p = cfg.train, cfg.train.parallel
    if p.data == "zero":
        raise ConfigError("tune buckets tunes DDP's train.parallel.bucket_cap_mb; data=zero does not use it "
                          "(ZeRO's buckets are reduce_bucket_size and allgather_bucket_size, in elements)")
    if p.data == "fsdp":
        raise ConfigError("tune buckets tunes DDP's train.parallel.bucket_cap_mb; data=fsdp (FSDP2) has no "
                          "bucket size: it communicates once per block")
    if p.tp > 1 or p.pp > 1:
        raise ConfigError(f"tune buckets tunes DDP's train.parallel.bucket_cap_mb; with tp={p.tp}, pp={p.pp} "
                          "data=ddp is FSDP2's replicate, one collective per block, and has no bucket size")
    if t.hostfile is not None or t.nodes > 1:
        raise ConfigError("tune buckets trains on this node only; set train.nodes=1 and no train.hostfile "
                          "(the bucket size that wins on one node is a starting point for several)")
    if t.nproc_per_node < 2:
        raise ConfigError(f"tune buckets needs at least 2 ranks to have gradients to sync "
                          f"(train.nproc_per_node={t.nproc_per_node}); pass --nproc 2 or more")


def profile_schedule(steps: int) -> dict[str, int]:
    """train.profile's wait/warmup/active for a run of `steps`: record about half of them, after at least
    two (DDP rebuilds its buckets after the first), never the last (its checkpoint and final eval)."""
    if steps < MIN_STEPS:
        raise ConfigError(f"--steps {steps}: at least {MIN_STEPS} (a skipped, a warm-up, a recorded and a last step)")
    active = (steps - 2) // 2
    return {"wait": steps - 2 - active, "warmup": 1, "active": active, "repeat": 1}


def point_config(cfg: RunConfig, bucket_cap_mb: float, steps: int) -> RunConfig:
    """`cfg` for one sweep point: `steps` steps, the profiler on, one checkpoint (the loop always saves
    the last step), no resume, the smallest evaluation, this bucket size."""
    tree = cfg.to_dict()
    t = tree["train"]
    t["max_steps"] = steps
    t["log_every"] = steps
    t["parallel"]["bucket_cap_mb"] = bucket_cap_mb
    t["profile"].update(enabled=True, **profile_schedule(steps))
    t["checkpoint"].update(every_steps=steps, keep_last=1, resume="never", async_save=False)
    t["eval"].update(every_steps=steps, samples=None, batches=1)
    return config_mod.from_dict(tree, source=f"tune buckets (bucket_cap_mb={bucket_cap_mb:g})")


# -- the planner's view -------------------------------------------------------------------------------

def plan_estimate(cfg: RunConfig, bandwidth_gbps: float) -> tuple[float, int]:
    """(gradient-sync seconds per step, collectives per step) as `llmpipe plan` computes them for `cfg`:
    its sync time (ring volume at the bandwidth) plus its latency term (one ALPHA_S per bucket)."""
    from llmpipe.parallel.mesh import LayoutError
    from llmpipe.tools import plan

    try:
        p = plan.plan(cfg, cfg.train.nproc_per_node, bandwidth_gbps=bandwidth_gbps)
    except LayoutError as err:
        raise ConfigError(f"train.parallel: {err}") from None
    return p.sync_s + p.latency_s, p.collectives


# -- one point ----------------------------------------------------------------------------------------

def _read_breakdown(folder: Path) -> list[dict[str, Any]]:
    path = folder / "profile" / "breakdown_rank0.json"
    try:
        rows = json.loads(path.read_text())["steps"]
    except (OSError, ValueError, KeyError):
        rows = []
    if not rows:
        raise TuneError(f"{path}: no profiled steps recorded")
    return rows


def measure(cfg: RunConfig, data_dir: Path, folder: Path) -> list[dict[str, Any]]:
    """Train `cfg` (a point_config) under torchrun into `folder` (emptied first); rank 0's profiled steps
    (llmpipe.train.profile's breakdown rows). The checkpoint is removed after."""
    from llmpipe.train.launch import TORCHRUN_LOGS, run_streaming, torchrun_argv
    from llmpipe.train.stage import check_layout as check_world
    from llmpipe.train.stage import failure, rank_env

    check_world(cfg, data_dir)
    if folder.exists():
        shutil.rmtree(folder)  # a previous sweep's point: its checkpoint would be resumed, its profile read
    folder.mkdir(parents=True)
    config_path = folder / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    argv = torchrun_argv(cfg.train.nproc_per_node, config_path, data_dir, folder)
    env = rank_env(cfg)
    agent_file = folder / TORCHRUN_LOGS / "agent-error-node0.json"
    env["TORCHELASTIC_ERROR_FILE"] = str(agent_file)
    since = time.time()
    with open(folder / "train.log", "w", encoding="utf-8") as out:
        code, _ = run_streaming(argv, lambda line: print(line, file=out, flush=True), env=env)
    if code != 0:
        err = failure(code, folder / TORCHRUN_LOGS, agent_file, since)
        raise TuneError(f"bucket_cap_mb={cfg.train.parallel.bucket_cap_mb:g}: {err} (output: {folder / 'train.log'})")
    shutil.rmtree(folder / "checkpoints", ignore_errors=True)  # a scratch run's weights: not worth the disk
    return _read_breakdown(folder)


def summarize(rows: list[dict[str, Any]]) -> tuple[float, float, float, float]:
    """(tokens/s, exposed and overlapped communication ms per step, step ms) of breakdown rows: their
    tokens over their time, and means."""
    n, total_ms = len(rows), sum(r["step_ms"] for r in rows)
    tokens = sum(r["tokens_per_s"] * r["step_ms"] / 1e3 for r in rows)
    return (tokens / (total_ms / 1e3), sum(r["communication_ms"] for r in rows) / n,
            sum(r["communication_background_ms"] for r in rows) / n, total_ms / n)


# -- the sweep ----------------------------------------------------------------------------------------

def tune_dir(cfg: RunConfig) -> Path:
    return cfg.run_dir() / "tune"


def bucket_sweep(cfg: RunConfig, values: list[float], steps: int = 10, bandwidth_gbps: float = 100.0,
                 repeats: int = 1) -> list[Point]:
    """Measure every bucket size in `values` on `cfg`'s layout (see the module docstring). With `repeats`,
    the values take turns (1 5 25 1 5 25 ...), so that a busy spell of a shared machine falls on all of them;
    a value's figures are over all its runs' profiled steps."""
    from llmpipe.lock import run_lock
    from llmpipe.stages import run_stage, stage_dir

    check_layout(cfg)
    if not bandwidth_gbps > 0:
        raise ConfigError(f"--bandwidth-gbps must be > 0 (got {bandwidth_gbps:g})")
    if repeats < 1:
        raise ConfigError(f"--repeats {repeats}: must be >= 1")
    points = [point_config(cfg, v, steps) for v in values]  # every value checked before anything runs
    estimates = [plan_estimate(p, bandwidth_gbps) for p in points]
    runs: list[list[tuple[Path, list[dict[str, Any]]]]] = [[] for _ in points]
    total = repeats * len(points)
    # The lock keeps the run's stages (and another sweep) off the run folder and the cores meanwhile.
    with run_lock(cfg.run_dir()):
        run_stage("prepare_data", cfg)
        data_dir = stage_dir(cfg.run_dir(), "prepare_data")
        for old in tune_dir(cfg).glob("buckets-*"):  # the previous sweep's (its traces are ~10 MB a rank)
            shutil.rmtree(old)
        for k in range(total):
            pcfg, r = points[k % len(points)], k // len(points)
            v = pcfg.train.parallel.bucket_cap_mb
            folder = tune_dir(cfg) / f"buckets-{v:g}{f'-r{r + 1}' if repeats > 1 else ''}"
            log.info("tune buckets [%d/%d] bucket_cap_mb=%g: %d steps on %d ranks in %s", k + 1, total, v, steps,
                     pcfg.train.nproc_per_node, folder)
            t0 = time.monotonic()
            rows = measure(pcfg, data_dir, folder)
            runs[k % len(points)].append((folder, rows))
            tok_s, comm_ms, _, step_ms = summarize(rows)
            log.info("tune buckets [%d/%d] bucket_cap_mb=%g: %.0f tokens/s, exposed comm %.1f ms/step, step %.1f ms "
                     "(%.0f s)", k + 1, total, v, tok_s, comm_ms, step_ms, time.monotonic() - t0)
    out = []
    for pcfg, (plan_s, buckets), done in zip(points, estimates, runs):
        rates = [summarize(rows)[0] for _, rows in done]
        out.append(Point(pcfg.train.parallel.bucket_cap_mb, *summarize([x for _, rows in done for x in rows]),
                         plan_ms=plan_s * 1e3, buckets=buckets, folders=tuple(f for f, _ in done),
                         spread=max(rates) / min(rates) - 1))
    return out


def best(points: list[Point]) -> Point:
    """The highest tokens/s (the first of equals)."""
    return max(points, key=lambda p: p.tokens_per_s)


def format_table(cfg: RunConfig, points: list[Point], steps: int, bandwidth_gbps: float) -> str:
    """The sweep as a table, the best row marked, then what each column means."""
    from llmpipe import device as dev

    win, configured, repeats = best(points), cfg.train.parallel.bucket_cap_mb, len(points[0].folders)
    sched = profile_schedule(steps)
    first = sched["wait"] + sched["warmup"] + 1
    turns = f", {repeats} runs per value taking turns" if repeats > 1 else ""
    lines = [f"bucket sweep: {cfg.run.name}, {cfg.model.flavor} model, data=ddp on {cfg.train.nproc_per_node} ranks "
             f"({dev.resolve(cfg.run.device).type}), {steps} steps per run{turns}, steps {first}-"
             f"{first + sched['active'] - 1} profiled on rank 0",
             f"{'':2}{'bucket_cap_mb':>13} {'buckets':>8} {'tokens/s':>10} {'comm ms/step':>13} {'overlapped ms':>14} "
             f"{'step ms':>9} {'plan sync ms':>13}" + (f" {'runs apart':>11}" if repeats > 1 else "")]
    for p in points:
        apart = f" {100 * p.spread:>10.1f}%" if repeats > 1 else ""
        lines.append(f"{'* ' if p is win else '  '}{p.bucket_cap_mb:>13g} {p.buckets:>8d} {p.tokens_per_s:>10,.0f} "
                     f"{p.comm_ms:>13.1f} {p.overlapped_ms:>14.1f} {p.step_ms:>9.1f} {p.plan_ms:>13.3f}{apart}"
                     + ("  (configured)" if p.bucket_cap_mb == configured else ""))
    return "\n".join([*lines, _best_line(points, configured), *_legend(bandwidth_gbps, repeats)])


def _best_line(points: list[Point], configured: float) -> str:
    """The winner, its gain over the configured value, and whether the runs could tell it from the next."""
    win = best(points)
    ref = next((p for p in points if p.bucket_cap_mb == configured), None)
    vs = (f", {100 * (win.tokens_per_s / ref.tokens_per_s - 1):+.1f}% over the configured {configured:g}"
          if ref is not None and ref is not win else "")
    others = [p for p in points if p is not win]
    if others and win.spread:
        second = best(others)
        margin = win.tokens_per_s / second.tokens_per_s - 1
        if margin < max(win.spread, second.spread):
            vs += (f"; {100 * margin:.1f}% ahead of {second.bucket_cap_mb:g}, less than their runs differ: "
                   "a tie on this machine")
    return f"best: bucket_cap_mb={win.bucket_cap_mb:g} ({win.tokens_per_s:,.0f} tokens/s{vs})"


def _legend(bandwidth_gbps: float, repeats: int) -> list[str]:
    return ["comm: communication the step waits for (exposed, on rank 0's main thread); overlapped: collectives "
            "on other threads meanwhile (DDP's bucket all-reduces during backward); both the profiler's",
            f"buckets, plan sync: `llmpipe plan`'s gradient sync at {bandwidth_gbps:g} Gbps (ring volume at the "
            "bandwidth + one latency per bucket)"
            + ("; runs apart: the fastest run's tokens/s over the slowest's, - 1" if repeats > 1 else "")]
