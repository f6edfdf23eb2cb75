"""torchrun's structured failures, in-place restarts and several nodes: an exception in one rank is
one error line naming that rank and its traceback file; a rank killed once is restarted in place and
the stage records it; two node agents on 127.0.0.1 train together, the survivor of a lost node fails
promptly, and one node then resumes from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe import stages
from llmpipe.checkpoint import io as ckpt
from llmpipe.stages import StageError
from llmpipe.train.launch import torchrun_argv
from tests.integration.test_faults import _config, _procs_matching, _wait_for_step

pytestmark = pytest.mark.slow


def _rank_pid(out: Path, local_rank: int, global_rank: int) -> int | None:
    """pid of the rank with this RANK among the processes working on `out`."""
    for pid in _procs_matching(str(out)):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={global_rank}".encode() in env and f"LOCAL_RANK={local_rank}".encode() in env:
            return pid
    return None


def _short(tmp_path: Path, name: str, **train) -> config_mod.RunConfig:
    """test_faults' tiny run, shortened: `train` overrides its train section."""
    path = _config(tmp_path, name)
    tree = yaml.safe_load(path.read_text())
    tree["train"].update({"max_steps": 6, "checkpoint": {"every_steps": 2, "keep_last": 10}, **train})
    path.write_text(yaml.safe_dump(tree))
    return config_mod.load(path)


def test_an_exception_in_rank_1_is_one_line_naming_rank_1_its_exception_and_traceback(tmp_path, monkeypatch):
    cfg = _short(tmp_path, "raise")
    stages.run_stage("prepare_data", cfg)
    monkeypatch.setenv("LLMPIPE_RAISE", "2:1")
    with pytest.raises(StageError) as info:
        stages.run_stage("train", cfg)
    line = str(info.value)
    assert "\n" not in line and not info.value.transient
    assert "rank 1 raised RuntimeError: LLMPIPE_RAISE: injected failure on rank 1 at step 2 (traceback: " in line
    traceback = Path(line.rpartition("(traceback: ")[2].rstrip(")"))
    assert traceback.is_file() and "injected failure" in traceback.read_text()
    assert "torchrun-logs" in traceback.parts


def test_a_killed_rank_fails_transiently_and_with_restarts_is_restarted_in_place(tmp_path, monkeypatch):
    cfg = _short(tmp_path, "restart")
    stages.run_stage("prepare_data", cfg)
    monkeypatch.setenv("LLMPIPE_KILL", "3:1")  # rank 1 SIGKILLs itself at step 3 of torchrun's first attempt
    with pytest.raises(StageError) as info:
        stages.run_stage("train", cfg)
    line = str(info.value)
    assert "\n" not in line and info.value.transient, line  # worth a retry, from the newest checkpoint
    assert "rank 1 died from a signal without an error file" in line

    restarts = cfg.model_copy(update={"train": cfg.train.model_copy(update={"restarts": 1})})
    manifest, executed = stages.run_stage("train", restarts)
    assert executed and manifest.metrics["restarts"] == 1
    assert manifest.metrics["resumed_from"] == 2  # the restart went on from the step-2 checkpoint


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _agent(cfg_path: Path, data: Path, out: Path, node_rank: int, endpoint: str, log: Path) -> subprocess.Popen:
    """One node's torchrun agent (one rank), in its own process group: the node."""
    argv = torchrun_argv(1, cfg_path, data, out, nnodes=2, node_rank=node_rank, rdzv_endpoint=endpoint,
                         rdzv_id="two-nodes")
    # rank 1 stops answering at step 5 (after the step-4 checkpoint), so the node is lost mid-training
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LLMPIPE_HANG": "5:1"}
    return subprocess.Popen(argv, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _wait_for_checkpoint(root: Path, step: int, timeout: float = 120) -> None:
    """Wait until the newest checkpoint that verifies is at `step` (a guard, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        newest = ckpt.latest_valid(root) if root.is_dir() else None
        if newest is not None and ckpt.read_meta(newest)["step"] >= step:
            return
        time.sleep(0.2)
    raise AssertionError(f"no verified checkpoint at step {step} under {root} in {timeout}s")


def test_two_node_agents_train_together_lose_one_then_one_node_resumes(tmp_path):
    cfg = _short(tmp_path, "nodes", max_steps=8, nproc_per_node=1, nodes=2,
                 rdzv_endpoint=f"127.0.0.1:{_free_port()}")
    stages.run_stage("prepare_data", cfg)
    data, out = stages.stage_dir(cfg.run_dir(), "prepare_data"), tmp_path / "train"
    out.mkdir()
    cfg_path = out / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg.to_dict()))
    nodes = [_agent(cfg_path, data, out, i, cfg.train.rdzv_endpoint, tmp_path / f"node{i}.log") for i in (0, 1)]
    try:
        _wait_for_step(out / "metrics.jsonl", 4)  # then rank 0 waits for rank 1, which hangs in step 5
        _wait_for_checkpoint(out / "checkpoints", 4)  # metrics come before the step-4 checkpoint is complete
        rank1 = _rank_pid(out, 0, global_rank=1)
        assert rank1 is not None
        # the node running rank 1 (c10d rendezvous assigns ranks by arrival) is lost: its agent and its rank
        lost = int(Path(f"/proc/{rank1}/stat").read_text().rpartition(")")[2].split()[1])  # the agent: rank 1's parent
        assert lost in [p.pid for p in nodes]
        os.killpg(lost, signal.SIGKILL)
        os.kill(rank1, signal.SIGKILL)  # torchrun starts its ranks in their own sessions
        survivor = next(p for p in nodes if p.pid != lost)
        code = survivor.wait(timeout=60)  # a guard against a hang, not a timing assertion
    finally:
        for p in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert code != 0, (tmp_path / "node0.log").read_text()[-3000:]
    assert not (out / "summary.json").exists()  # it did not finish

    from tests.conftest import torchrun

    one = cfg.model_copy(update={"train": cfg.train.model_copy(update={"nodes": 1, "rdzv_endpoint": None})})
    code, text = torchrun(one, data, out, nproc=1)  # the rerun on the node that is left
    assert code == 0, text[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_from"] == 4 and summary["steps"] == 8 and summary["world_size"] == 1
