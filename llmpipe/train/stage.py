"""The train stage: launch torchrun over llmpipe.train.main and collect what it wrote."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import yaml

from llmpipe import device as dev
from llmpipe.checkpoint import io as ckpt
from llmpipe.stages import StageContext, StageError, StageResult
from llmpipe.train import metrics as metrics_mod
from llmpipe.train.launch import deepspeed_argv, run_streaming, torchrun_argv

log = logging.getLogger("llmpipe.train")


def _env(cfg) -> dict[str, str]:
    env = dict(os.environ)
    env.update(dev.dist_env(cfg.run.device, cfg.train.dist_timeout_s, cfg.train.hccl))
    env.setdefault("OMP_NUM_THREADS", str(cfg.train.threads_per_proc or
                                          max(1, (os.cpu_count() or 1) // cfg.train.nproc_per_node)))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _hosts(cfg) -> list[str]:
    """The hostfile's hosts, or [] on one node (no hostfile)."""
    if cfg.train.hostfile is None:
        return []
    hostfile = Path(cfg.train.hostfile)
    hosts = [ln.split()[0] for ln in hostfile.read_text().splitlines() if ln.strip() and not ln.startswith("#")] \
        if hostfile.is_file() else []
    if not hosts:
        raise StageError(f"train.hostfile: {hostfile} is missing or lists no hosts ('host slots=N' per line)")
    return hosts


def _launch_argv(cfg, config_path: Path, data_dir: Path, out: Path) -> list[str]:
    """torchrun on one node; the DeepSpeed launcher over a hostfile for several."""
    t = cfg.train
    hosts = _hosts(cfg)
    if not hosts:
        return torchrun_argv(t.nproc_per_node, config_path, data_dir, out)
    return deepspeed_argv(Path(t.hostfile), t.nproc_per_node, config_path, data_dir, out,
                          master_addr=t.master_addr or hosts[0], master_port=t.master_port)


def check_layout(cfg, data_dir: Path) -> None:
    """Validate dp x tp x pp against the world size this launch will have and the model, before any
    process starts: one line naming the numbers (the ranks check again at start)."""
    from llmpipe.models.llama import model_args
    from llmpipe.parallel import mesh
    from llmpipe.parallel.model_parallel import check_supported

    p = cfg.train.parallel
    world = cfg.train.nproc_per_node * max(1, len(_hosts(cfg)))
    vocab = json.loads((Path(data_dir) / "data_meta.json").read_text())["vocab_size"]
    try:
        mesh.validate(p, model_args(cfg.model, vocab_size=vocab), world, cfg.train.micro_batch_size)
        if p.tp > 1 or p.pp > 1:
            check_supported(cfg, dev.precision(dev.resolve(cfg.run.device), cfg.train.precision.dtype))
    except mesh.LayoutError as err:
        raise StageError(f"train.parallel: {err} (world size {world} = nproc_per_node "
                         f"{cfg.train.nproc_per_node} x {max(1, len(_hosts(cfg)))} node(s))") from None


def run(ctx: StageContext) -> StageResult:
    cfg, out = ctx.cfg, ctx.work_dir
    data_dir = ctx.inputs["prepare_data"][0]
    check_layout(cfg, data_dir)
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    argv = _launch_argv(cfg, config_path, data_dir, out)
    log.info("launching: %s", " ".join(argv))
    code, tail = run_streaming(argv, lambda line: log.info("%s", line), env=_env(cfg))
    if code != 0:
        # a rank's one-line "error: ..." first, then tracebacks' last lines, then whatever came last
        errors = [ln for ln in tail if "error:" in ln] or [ln for ln in tail if "Error" in ln]
        detail = (errors or tail or ["no output"])[-1].strip()
        # A rank that died from a signal (OOM killer, preemption, a lost node) may well succeed on a
        # retry, which resumes from the newest checkpoint; an exception inside a rank will not.
        killed = code < 0 or any("Signals." in ln or "SIGKILL" in ln for ln in tail)
        raise StageError(f"training failed: torchrun exited with {code}: {detail}", transient=killed)
    final = ckpt.latest_valid(out / "checkpoints")
    if final is None or ckpt.read_meta(final)["step"] != cfg.train.max_steps:
        raise StageError(f"training ended without a valid checkpoint at step {cfg.train.max_steps} in {out}")
    return StageResult(
        outputs={"checkpoint": final.relative_to(out).as_posix(), "metrics": metrics_mod.METRICS,
                 "model_config": "model_config.json", "summary": "summary.json", "config": "config.yaml"},
        metrics=_summary_metrics(out),
    )


def _summary_metrics(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    records = metrics_mod.read(out / metrics_mod.METRICS)
    evals = [r for r in records if "val_loss" in r]
    if evals:  # the first eval of the whole run, even when this attempt resumed
        summary["val_loss_start"] = evals[0]["val_loss"]
    return summary
