"""Measured tuning: `llmpipe tune buckets CONFIG` sweeps DDP's gradient bucket size.

For each bucket_cap_mb value the run's layout trains a few steps under torchrun, with the profiler on
steps in the middle (not the first, where DDP builds and then rebuilds its buckets, nor the last, which
saves a checkpoint), into a scratch folder `artifacts/<run>/tune/buckets-<value>[-r<k>]/`. Rank 0's breakdown
(llmpipe.train.profile) gives tokens/s and the communication the step waits for (exposed); the
folders (traces, logs, metrics; the checkpoint removed) stay until the next sweep. Beside each
row: the planner's gradient-sync estimate for that bucket size, as `llmpipe plan` computes it (volume at
the bandwidth plus one latency per bucket). The data come from the run's prepare_data stage, run or
reused through the stage machinery; the train stage's folder and checkpoints are never touched.

`write_bucket_cap` sets the winner in the config file with a minimal text edit (comments and order
kept), verified against the parsed YAML before the file is replaced. A symlinked config has its target
edited; the original is kept as CONFIG.bak, or CONFIG.bak.1, .2, ... when earlier backups exist (one
is never overwritten, nor written through a link).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import stat
import tempfile
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
KEY = ("train", "parallel", "bucket_cap_mb")
MAX_BACKUPS = 100  # CONFIG.bak, CONFIG.bak.1 ... CONFIG.bak.99: --write refuses beyond


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
    from llmpipe import plan
    from llmpipe.parallel.mesh import LayoutError

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


# -- --write ------------------------------------------------------------------------------------------

_FOUND = re.compile(r"(?<![\w-])bucket_cap_mb[ \t]*:[ \t]*(?P<value>[^,}\s#]*)")
_TOP = re.compile(r"train[ \t]*:[ \t]*(#.*)?$")
_PARALLEL = re.compile(r"(?P<indent>[ \t]+)parallel[ \t]*:[ \t]*(?P<rest>.*)$")


def _number(v: float) -> str:
    """`v` as a YAML number PyYAML reads back as `v` (it reads `1e-05` as a string, `1.0e-05` as a float)."""
    text = str(int(v)) if v == int(v) else repr(v)
    return text.replace("e", ".0e", 1) if "e" in text and "." not in text else text


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def _content(line: str) -> bool:
    return bool(line.strip()) and not line.lstrip().startswith("#")


def _edit_existing(text: str, value: str) -> str | None:
    """Replace the value of the one uncommented `bucket_cap_mb:` (block or flow style); None if there are several."""
    found = [m for m in _FOUND.finditer(text)
             if "#" not in text[text.rfind("\n", 0, m.start()) + 1:m.start()]]
    if len(found) != 1:
        return None
    m = found[0]
    return text[:m.start("value")] + value + text[m.end("value"):]


def _insert(text: str, value: str) -> str | None:
    """Add bucket_cap_mb under a block-style `train:` (into its `parallel:`, block or flow, or a new one),
    or a new train section at the end; None when the file's shape is not one of these."""
    nl = "\r\n" if "\r\n" in text else "\n"
    lines = text.splitlines(keepends=True)
    tops = [i for i, ln in enumerate(lines) if _TOP.match(ln.rstrip("\r\n"))]
    if not tops:
        if re.search(r"^train\b", text, re.M):
            return None  # train in another shape (flow style, a key with odd spacing)
        sep = "" if not text or text.endswith("\n") else nl
        return text + sep + f"train:{nl}  parallel:{nl}    bucket_cap_mb: {value}{nl}"
    start = tops[0] + 1
    end = next((i for i in range(start, len(lines)) if _content(lines[i]) and _indent(lines[i]) == 0), len(lines))
    children = [i for i in range(start, end) if _content(lines[i])]
    child = " " * (_indent(lines[children[0]]) if children else 2)
    for i in children:
        m = _PARALLEL.match(lines[i].rstrip("\r\n"))
        if not m or m["indent"] != child:
            continue
        rest = m["rest"]
        if rest.startswith("{"):
            inner = "" if re.match(r"\{\s*\}", rest) else ", "
            lines[i] = lines[i].replace("{", "{bucket_cap_mb: " + value + inner, 1)
        elif not rest or rest.startswith("#"):
            below = next((j for j in range(i + 1, end) if _content(lines[j])), None)
            deeper = below is not None and _indent(lines[below]) > len(child)
            grand = " " * _indent(lines[below]) if deeper else child * 2
            lines.insert(i + 1, f"{grand}bucket_cap_mb: {value}{nl}")
        else:
            return None
        return "".join(lines)
    lines.insert(start, f"{child}parallel:{nl}{child * 2}bucket_cap_mb: {value}{nl}")
    return "".join(lines)


def _unshared(tree: Any) -> Any:
    """A copy of a parsed YAML tree in which no two places share a dict or list."""
    if isinstance(tree, dict):
        return {k: _unshared(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_unshared(v) for v in tree]
    return tree


def edit_text(text: str, v: float) -> str | None:
    """`text` (a config's YAML) with train.parallel.bucket_cap_mb set to `v` and nothing else changed, or
    None when no minimal edit does that (checked by parsing both)."""
    try:
        old = yaml.safe_load(text) or {}
    except yaml.YAMLError:
        return None
    expected = _unshared(old)  # NOTE: not deepcopy, which keeps an alias's sharing: the edit must change one place
    node = expected
    for key in KEY[:-1]:
        if not isinstance(node, dict):
            return None
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    if not isinstance(node, dict):
        return None
    node[KEY[-1]] = v
    value = _number(v)
    for new in (_edit_existing(text, value), _insert(text, value)):
        try:
            if new is not None and yaml.safe_load(new) == expected:
                return new
        except yaml.YAMLError:
            continue
    return None


def _backup(path: Path, data: bytes, st: os.stat_result) -> Path:
    """`data`, the original of `path`, saved in a new file `path`.bak, or `path`.bak.1, .2, ... when that
    name is taken: an earlier backup is never overwritten, and a link planted at one of the names is
    never written through (O_EXCL creates the file itself or fails)."""
    for i in range(MAX_BACKUPS):
        backup = path.with_name(f"{path.name}.bak" + (f".{i}" if i else ""))
        try:
            fd = os.open(backup, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            os.utime(fd, ns=(st.st_atime_ns, st.st_mtime_ns))  # as shutil.copy2 kept them
        return backup
    raise TuneError(f"{path}: {path.name}.bak and {MAX_BACKUPS - 1} numbered backups of it exist; remove the ones "
                    "you do not need; not written")


def write_bucket_cap(path: Path, v: float, overrides: list[str] | tuple[str, ...] = ()) -> str:
    """Set train.parallel.bucket_cap_mb to `v` in the config file `path`, keeping everything else of the
    text. A symlink's target is the file edited (the link stays). The original is kept beside the file
    edited, as a new file (see `_backup`). The edited text must load (with `overrides`, those setting
    the bucket size left out) with the new value before it replaces the file, atomically, from a
    temporary file in the same folder. Returns a line to print."""
    path = Path(path)
    target = Path(os.path.realpath(path))  # NOTE: replacing `path` itself would turn a link into a plain file
    if not target.is_file():
        raise TuneError(f"{path}: not a regular file; not written")
    data = target.read_bytes()
    st = os.stat(target)
    text = data.decode("utf-8")
    try:
        current = (yaml.safe_load(text) or {}).get("train", {}).get("parallel", {}).get("bucket_cap_mb")
    except (yaml.YAMLError, AttributeError):
        current = None
    if current == v:
        return f"{path}: train.parallel.bucket_cap_mb is already {_number(v)}; not rewritten"
    new = edit_text(text, v)
    if new is None:
        raise TuneError(f"{path}: cannot set bucket_cap_mb with a minimal edit of this file; set "
                        f"train.parallel.bucket_cap_mb: {_number(v)} there yourself")
    keep = [o for o in overrides if not o.partition("=")[0].strip().endswith("bucket_cap_mb")]
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.tune-", suffix=".tmp", dir=target.parent)
    tmp = Path(name)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as f:
            f.write(new)
            f.flush()
            os.fsync(fd)
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
        try:
            loaded = config_mod.load(tmp, keep).train.parallel.bucket_cap_mb
        except ConfigError as err:
            raise TuneError(f"{path}: the edited file does not load ({err}); not written") from None
        if loaded != v:
            raise TuneError(f"{path}: the edited file reads bucket_cap_mb={loaded:g}, not {v:g}; not written")
        backup = _backup(target, data, st)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    where = f"{target} (the target of {path})" if path.is_symlink() else str(path)
    return f"wrote train.parallel.bucket_cap_mb: {_number(v)} to {where} (the original is {backup})"
