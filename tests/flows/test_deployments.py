"""Deployments against a real Prefect server (SQLite, 127.0.0.1): serve prefect.yaml's deployments,
trigger one with `prefect deployment run ... --watch`, check the run's state and artifacts; cancel
a run mid-training and check that no training process survives it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from llmpipe.config import STAGES
from llmpipe.manifest import Manifest
from llmpipe.stages import stage_dir

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:  # noqa: S310 (a loopback URL we built)
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not come up in {timeout}s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wait_deployments(env: dict, names: list[str], runner: subprocess.Popen, home: Path, timeout: float = 120):
    deadline = time.monotonic() + timeout
    for name in names:
        while True:
            out = subprocess.run([str(BIN / "prefect"), "deployment", "inspect", name], env=env,
                                 capture_output=True, text=True)
            if out.returncode == 0:
                break
            if runner.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{name} was not registered: {(home / 'serve.log').read_text()[-3000:]}")
            time.sleep(1)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-home")
    port = _free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_API_URL": f"http://127.0.0.1:{port}/api", "PREFECT_LOGGING_LEVEL": "WARNING"}
    log = open(home / "server.log", "w")  # noqa: SIM115 (closed below)
    srv = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port),
                            "--no-ui", "--analytics-off"], env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/api/health")
        serve_log = open(home / "serve.log", "w")  # noqa: SIM115
        runner = subprocess.Popen([sys.executable, "-m", "flows.serve"], cwd=ROOT, env=env, stdout=serve_log,
                                  stderr=subprocess.STDOUT)
        try:
            _wait_deployments(env, ["train-to-deploy/on-demand", "train-to-deploy/nightly",
                                    "serve-latest/latest-passing"], runner, home)
            yield env, home
        finally:
            _stop(runner)
            serve_log.close()
    finally:
        _stop(srv)
        log.close()


def _config(folder: Path, name: str, max_steps: int) -> Path:
    cfg = {"run": {"name": name, "artifacts_dir": str(folder / "artifacts"), "device": "cpu"},
           "data": {"inputs": ["{stdlib}/json/*.py"], "seq_len": 32, "val_fraction": 0.2,
                    "tokenizer": {"vocab_size": 300}},
           "model": {"flavor": "debug"},
           "train": {"nproc_per_node": 2, "micro_batch_size": 2, "max_steps": max_steps, "threads_per_proc": 1,
                     "checkpoint": {"every_steps": 5}, "eval": {"every_steps": 1000, "batches": 1}},
           "export": {"parity_shapes": [[1, 8]]},
           "benchmark": {"variants": ["fp32", "int8"], "shapes": [[1, 16]], "warmup": 1, "iters": 2, "threads": 1},
           "evaluate": {"limit": 4}}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _deployment_run(env: dict, config: Path, *extra: str, watch: bool = True) -> subprocess.CompletedProcess:
    argv = [str(BIN / "prefect"), "deployment", "run", "train-to-deploy/on-demand", "--param", f"config={config}",
            *extra]
    if watch:
        argv += ["--watch", "--watch-timeout", "600"]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=700)


def test_deployment_run_watch_completes_the_pipeline(server, tmp_path):
    env, _ = server
    config = _config(tmp_path, "deployed", max_steps=4)
    out = _deployment_run(env, config, "--param", 'overrides=["train.max_steps=3"]')
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Completed" in out.stdout
    run_dir = tmp_path / "artifacts" / "deployed"
    for stage in STAGES:
        folder = stage_dir(run_dir, stage)
        manifest = Manifest.read(folder)
        assert manifest is not None and manifest.verify(folder) is None, stage
    assert Manifest.read(run_dir / "02_train").metrics["steps"] == 3  # the override reached the flow
    assert (run_dir / "report.html").is_file()


def _flow_run_id(text: str) -> str:
    for line in text.splitlines():
        if "UUID:" in line:
            return line.split("UUID:")[1].strip()
    raise AssertionError(f"no flow run id in: {text[-2000:]}")


def _procs_matching(text: str) -> list[int]:
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if text in (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(d.name))
            except OSError:
                pass
    return found


def test_cancelling_a_flow_run_kills_the_training_processes(server, tmp_path):
    env, _ = server
    config = _config(tmp_path, "cancelled", max_steps=100000)
    started = _deployment_run(env, config, watch=False)
    assert started.returncode == 0, started.stdout + started.stderr
    run_id = _flow_run_id(started.stdout)
    partial = tmp_path / "artifacts" / "cancelled" / ".02_train.partial"
    deadline = time.monotonic() + 300
    while not (partial / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _procs_matching(str(partial)), "training did not start"
    out = subprocess.run([str(BIN / "prefect"), "flow-run", "cancel", run_id], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    deadline = time.monotonic() + 90
    while _procs_matching(str(partial)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _procs_matching(str(partial)) == [], "training processes outlived the cancelled flow run"
    state = subprocess.run([str(BIN / "prefect"), "flow-run", "inspect", run_id], env=env, capture_output=True,
                           text=True, timeout=60).stdout
    assert "CANCELLED" in state.upper(), state[-2000:]
    json.dumps(state)  # readable text
