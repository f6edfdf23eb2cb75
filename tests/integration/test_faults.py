"""Faults during training: a rank SIGKILLed mid-run fails the stage promptly with no process left,
and the rerun resumes from the newest checkpoint to final weights bitwise equal to an
uninterrupted run. A killed pipeline process leaves no orphan rank behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe import stages
from llmpipe.checkpoint import io as ckpt
from tests.conftest import checkpoint_weights

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, name: str) -> Path:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(12):
            (corpus / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    cfg = {"run": {"name": name, "artifacts_dir": str(tmp_path / "artifacts"), "device": "cpu", "seed": 5},
           "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 32, "val_fraction": 0.2,
                    "tokenizer": {"vocab_size": 300}},
           "model": {"flavor": "debug"},
           # NOTE: grad_accum_steps=1 for bitwise equality: the first step after a resume syncs every
           # micro-step (DDP static_graph), which sums the same gradients in another order.
           "train": {"nproc_per_node": 2, "micro_batch_size": 4, "grad_accum_steps": 1, "max_steps": 40,
                     "threads_per_proc": 1, "log_every": 1, "checkpoint": {"every_steps": 5, "keep_last": 10},
                     "eval": {"every_steps": 100, "batches": 1}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _procs_matching(text: str) -> list[int]:
    """pids whose command line contains `text` (excluding this process)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                pids.append(int(d.name))
    return pids


def _rank_pid(partial: Path, local_rank: int) -> int | None:
    for pid in _procs_matching(str(partial)):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"torch.distributed.run" not in cmd and f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    return None


def _wait_for_step(metrics: Path, step: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metrics.is_file():
            steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if '"loss"' in x]
            if steps and steps[-1] >= step:
                return
        time.sleep(0.2)
    raise AssertionError(f"training did not reach step {step} in {timeout}s")


def _stage(args: list[str], **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "llmpipe", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_sigkill_one_rank_then_resume_bitwise(tmp_path):
    ref_cfg = config_mod.load(_config(tmp_path, "ref"))
    for s in ("prepare_data", "train"):
        stages.run_stage(s, ref_cfg)

    path = _config(tmp_path, "faulty")
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)
    partial = cfg.run_dir() / ".02_train.partial"
    proc = _stage(["stage", "train", str(path)])
    _wait_for_step(partial / "metrics.jsonl", 12)
    victim = _rank_pid(partial, 1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    seconds = time.monotonic() - t0
    print(f"SIGKILL -> stage failed in {seconds:.1f}s")
    assert proc.returncode == 1, out
    assert "error: training failed: torchrun exited with" in out.strip().splitlines()[-1]
    assert seconds < 60
    assert _procs_matching(str(partial)) == []  # the whole torchrun group is gone

    newest = ckpt.latest_valid(partial / "checkpoints")
    assert newest is not None
    resume_step = ckpt.read_meta(newest)["step"]
    assert 5 <= resume_step < 40
    manifest, executed = stages.run_stage("train", cfg)  # the rerun resumes
    assert executed and manifest.metrics["resumed_from"] == resume_step
    a = checkpoint_weights(ckpt.step_dir(ref_cfg.run_dir() / "02_train" / "checkpoints", 40))
    b = checkpoint_weights(ckpt.step_dir(cfg.run_dir() / "02_train" / "checkpoints", 40))
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise


def test_killed_pipeline_process_leaves_no_rank_behind(tmp_path):
    """What a cancelled flow run does to its process: the ranks must not outlive it."""
    path = _config(tmp_path, "cancel")
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)
    partial = cfg.run_dir() / ".02_train.partial"
    proc = _stage(["stage", "train", str(path)])
    _wait_for_step(partial / "metrics.jsonl", 3)
    assert _rank_pid(partial, 0) is not None
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: PR_SET_PDEATHSIG must do it
    proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while _procs_matching(str(partial)) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert _procs_matching(str(partial)) == []


def test_a_failed_training_prints_one_error_line_and_keeps_torchruns_report_in_its_log(tmp_path):
    path = _config(tmp_path, "report")
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)
    env = {**os.environ, "LLMPIPE_RAISE": "2:1"}  # rank 1 raises at step 2
    proc = _stage(["stage", "train", str(path)], env=env)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 1, out[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: training failed: torchrun exited with 1: rank 1 raised RuntimeError: "
                           "LLMPIPE_RAISE: injected failure on rank 1 at step 2 (traceback: "), out[-3000:]
    assert "ChildFailedError" not in out and "Traceback" not in out, out[-3000:]  # torchrun's 40-line report
    assert "[rank0] step 1/40" in out  # the ranks' progress still shows
    (kept,) = (cfg.run_dir() / "failed").glob("02_train-*")
    log = (kept / "torchrun-logs" / "stderr-node0.log").read_text()
    assert "ChildFailedError" in log and "injected failure on rank 1" in log
