"""Experiment tracking and the registry on MLflow (issue 28), as a user meets them through `llmpipe`: one
small run (the debug flavor, 6 then 9 steps) whose training is killed, resumed on one process and then
warm-started to a longer horizon, logged to the embedded SQLite store; then the same run folder logged to a
real `mlflow server` process on a loopback port that stops answering mid-run. MLflow is read back with its
own client."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from llmpipe import cli
from tests.integration.test_reruns import _config

pytestmark = pytest.mark.slow

NAME = "trk"
TINY_BENCH = {"variants": ["int8"], "shapes": [[1, 16]], "warmup": 0, "iters": 1, "threads": 1, "torch_baseline": False,
              "llm": {"prompt_lens": [8], "batches": [1], "decode_prompt_len": 8, "new_tokens": 2, "repeats": 1,
                      "sample_tokens": 2},
              "quality": {"samples": 2, "continuation_prompts": 0}}
# int8 (per channel, down_proj and head in fp32) may move no argmax on this toy: a KL of 0 is out of its reach
FAILING_GATE = ["--set", "benchmark.quality.enforce=false", "--set", "benchmark.quality.int8.min_top1=1.0",
                "--set", "benchmark.quality.int8.max_ppl_increase=0.0", "--set", "benchmark.quality.int8.max_kl=0.0"]


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(uri, registry_uri=uri)


def _steps(c, run_id: str, key: str = "loss") -> list[int]:
    return [m.step for m in sorted(c.get_metric_history(run_id, key), key=lambda m: m.timestamp)]


def _run_id(run_dir: Path, uri: str) -> str:
    return json.loads((run_dir / "mlflow.json").read_text())["stores"][uri]["run_id"]


def _stage(path: Path, stage: str, *more: str) -> int:
    return cli.main(["stage", stage, str(path), *more])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run trained three times over, each launch logged: killed at step 5 (checkpoint at 3), resumed on
    one process (the same fingerprint: a topology change), then max_steps 6 -> 9 (a warm start at 6).
    Returns the config, the run folder, the SQLite URI and the loss steps MLflow held after each launch."""
    tmp = tmp_path_factory.mktemp("tracking")
    path = _config(tmp, NAME, eval={"every_steps": 3, "batches": 1})
    tree = yaml.safe_load(path.read_text())
    tree["data"]["workers"] = 1  # tokenized in-process: no pool to spawn for 12 small files
    tree["export"] = {"parity_shapes": [[1, 8]]}
    tree["benchmark"] = TINY_BENCH
    tree["tracking"] = {"mlflow": {"enabled": True}}
    path.write_text(yaml.safe_dump(tree))
    artifacts = tmp / "artifacts"
    run_dir, uri = artifacts / NAME, f"sqlite:///{artifacts.resolve() / 'mlflow.db'}"
    assert _stage(path, "prepare_data") == 0
    os.environ["LLMPIPE_KILL"] = "5:1"  # rank 1 SIGKILLs itself at step 5 of torchrun's first attempt
    try:
        assert _stage(path, "train") == 1
    finally:
        del os.environ["LLMPIPE_KILL"]
    c = _client(uri)
    seen = {"killed": _steps(c, _run_id(run_dir, uri))}
    assert _stage(path, "train", "--set", "train.nproc_per_node=1", "--set", "train.grad_accum_steps=2") == 0
    seen["resumed"] = _steps(c, _run_id(run_dir, uri))
    tree["train"].update(max_steps=9, nproc_per_node=1, grad_accum_steps=2)  # a new attempt, warm-started at 6
    path.write_text(yaml.safe_dump(tree))
    assert _stage(path, "train") == 0
    seen["warm"] = _steps(c, _run_id(run_dir, uri))
    return path, run_dir, uri, seen


def test_one_mlflow_run_follows_a_killed_training_its_resume_on_one_process_and_a_warm_start(trained, capsys):
    path, run_dir, uri, seen = trained
    c = _client(uri)
    run_id = _run_id(run_dir, uri)
    # killed at step 5 after the checkpoint at 3: what metrics.jsonl had then was logged
    assert seen["killed"] == list(range(1, len(seen["killed"]) + 1)) and len(seen["killed"]) >= 3
    # the resume (from step 3, one process instead of two) continues the curve: no step twice, none out of order
    assert seen["resumed"] == [1, 2, 3, 4, 5, 6]
    assert seen["warm"] == list(range(1, 10))
    assert _steps(c, run_id, "val_loss") == [0, 3, 6, 9]
    run = c.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.optim.lr"] == "0.0003"
    assert run.data.params["train.max_steps"] == "6" and run.data.tags["config.train.max_steps"] == "9"
    assert run.data.tags["stage.train.status"] == "completed"
    assert run.data.tags["stage.train.last_failure"].split(": ", 1)[1].startswith("StageError")
    assert run.data.tags["fingerprint.train"] == json.loads((run_dir / "02_train" / "manifest.json").read_text())[
        "fingerprint"]
    assert {"data.digest", "version.torch", "version.llmpipe"} <= set(run.data.tags)
    # attempts: one nested run per train fingerprint; the resume kept its attempt, the warm start opened one
    children = c.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{run_id}'",
                             order_by=["attributes.start_time ASC"])
    assert len(children) == 2
    first, warm = children
    assert _steps(c, first.info.run_id) == [1, 2, 3, 4, 5, 6] and first.data.tags["llmpipe.state"] == "superseded"
    assert _steps(c, warm.info.run_id) == [7, 8, 9] and warm.data.tags["warm_start.step"] == "6"
    assert warm.data.params["train.max_steps"] == "9"

    # `llmpipe track` back-fills: all of it is there already, so nothing is logged twice
    assert cli.main(["track", NAME, "--artifacts-dir", str(run_dir.parent)]) == 0
    assert capsys.readouterr().out.startswith(f"track: {NAME} -> MLflow run {run_id} in {uri}")
    assert _steps(c, run_id) == list(range(1, 10)) and _steps(c, run_id, "val_loss") == [0, 3, 6, 9]
    assert len(c.get_metric_history(run_id, "train.duration_s")) == 2  # two completed trainings, once each


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path):
    """A real `mlflow server` on a free loopback port (its own SQLite store and artifact folder)."""
    port = _free_port()
    mlflow = Path(sys.executable).parent / "mlflow"
    proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                             "--artifacts-destination", str(tmp_path / "server-artifacts"), "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no GenAI job workers
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, "mlflow server did not start"
        time.sleep(0.5)
    try:
        yield url, proc
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _tracking_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "llmpipe.tracking" and r.levelname == "WARNING"]


def test_a_server_that_stops_answering_costs_one_warning_and_the_registry_promotes_by_gates(trained, server,
                                                                                            caplog, capsys):
    path, run_dir, _, _ = trained
    url, proc = server
    at = ["--set", f"tracking.mlflow.tracking_uri={url}", "--set", "tracking.mlflow.timeout_s=2",
          "--set", "tracking.mlflow.retries=0"]
    c = _client(url)
    # a new store: the first sync there back-fills the whole run, and consolidate's hf/ is version 1
    assert _stage(path, "consolidate", *at) == 0
    run_id = _run_id(run_dir, url)
    assert _steps(c, run_id) == list(range(1, 10))
    version = c.get_model_version(NAME, "1")
    assert version.tags["llmpipe.gates"] == "pending" and version.tags["llmpipe.run_dir"] == str(run_dir)
    hf = {a.path.rsplit("/", 1)[1] for a in c.list_artifacts(run_id, version.source.rsplit("/artifacts/", 1)[1])}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= hf

    # the server stops answering: export_onnx still completes, for one warning line
    caplog.clear()
    os.killpg(proc.pid, signal.SIGSTOP)
    try:
        assert _stage(path, "export_onnx", *at) == 0
    finally:
        os.killpg(proc.pid, signal.SIGCONT)
    assert (run_dir / "04_export_onnx" / "manifest.json").is_file()
    (warning,) = _tracking_warnings(caplog)
    assert warning.startswith(f"tracking: MLflow at {url} failed: ") and "\n" not in warning
    assert _stage(path, "convert_om", *at) == 0  # no CANN here: recorded as skipped, with the reason

    # back: the benchmark's sync logs what the last one missed; its int8 gate fails, so promote refuses
    assert _stage(path, "benchmark", *at, *FAILING_GATE) == 0
    run = c.get_run(run_id)
    assert run.data.tags["stage.export_onnx.status"] == "completed"
    assert {"06_benchmark/results.md", "06_benchmark/latency.png"} <= {a.path for a in c.list_artifacts(run_id,
                                                                                                      "06_benchmark")}
    assert "report.html" in {a.path for a in c.list_artifacts(run_id)}
    version = c.get_model_version(NAME, "1")
    # a verdict per variant: int8 failed (fp32 passed, so the version as a whole is not refused for int8's sake)
    assert version.tags["llmpipe.gates.variant.int8"] == "failed" and "llmpipe.deploy.export_onnx" in version.tags
    capsys.readouterr()
    assert cli.main(["promote", f"{NAME}/1", "--alias", "production", "--variant", "int8",
                     "--tracking-uri", url]) == 1
    assert capsys.readouterr().err == (f"error: {NAME}/1: its int8 variant's gates are failed; not promoted to "
                                       "@production (--force promotes anyway, recorded on the version)\n")

    # the default gates: the benchmark runs again and passes; the version becomes the candidate, then production
    assert _stage(path, "benchmark", *at) == 0
    assert c.get_model_version_by_alias(NAME, "candidate").version == "1"
    capsys.readouterr()
    # a run name: its current version, in the store its recorded config names (the server's)
    assert cli.main(["promote", NAME, "--alias", "production", "--artifacts-dir", str(run_dir.parent)]) == 0
    assert capsys.readouterr().out == f"promote: {NAME}/1 -> @production (gates passed)\n"

    # generate resolves models:/NAME@production to the run folder that made it: the same text as the run's
    prompt = ["--prompt", "word1 word2", "--max-new-tokens", "6"]
    assert cli.main(["generate", f"models:/{NAME}@production", "--tracking-uri", url, *prompt]) == 0
    by_alias = capsys.readouterr().out.rsplit("\n[", 1)[0]  # the text, without the closing line's timings
    assert cli.main(["generate", str(run_dir), *prompt]) == 0
    assert capsys.readouterr().out.rsplit("\n[", 1)[0] == by_alias and by_alias.startswith("word1 word2")

    # the Prefect flow run's artifact links the MLflow run (a server: the UI's address)
    from llmpipe import config as config_mod
    from llmpipe import tracking

    link, text = tracking.link(config_mod.load(path, [f"tracking.mlflow.tracking_uri={url}"]))
    assert link == f"{url}/#/experiments/{c.get_run(run_id).info.experiment_id}/runs/{run_id}" and link in text

    assert cli.main(["runs", "--tracking-uri", url]) == 0
    header, row = capsys.readouterr().out.splitlines()
    assert header.split() == ["run", "status", "steps", "val_loss", "tokens/s", "gates", "model", "aliases"]
    assert row.split()[:3] == [NAME, "FINISHED", "9"] and row.split()[5:] == ["passed", f"{NAME}/1",
                                                                              "candidate,production"]


def test_bad_tracking_input_is_one_line_and_never_skips_the_pipelines_work(trained, capsys, caplog):
    path, run_dir, uri, _ = trained
    capsys.readouterr()
    assert _stage(path, "consolidate", "--set", "tracking.mlflow.tracking_uri=ftp://host/x") == 2
    assert capsys.readouterr().err == (f"error: {path}: tracking.mlflow.tracking_uri: 'ftp://host/x' has the scheme "
                                       "'ftp', which MLflow has no store for (http, https, sqlite, file, postgresql, "
                                       "mysql, ...)\n")
    assert _stage(path, "consolidate", "--set", "tracking.mlflow.model_name=team/llama") == 2
    assert capsys.readouterr().err == (f"error: {path}: tracking.mlflow.model_name: 'team/llama' is refused by "
                                       "MLflow's registry (not empty, no '/' or ':', no '..' or '.')\n")
    closed = f"http://127.0.0.1:{_free_port()}"
    caplog.clear()
    assert _stage(path, "consolidate", "--set", f"tracking.mlflow.tracking_uri={closed}") == 0  # the work is done
    assert (run_dir / "03_consolidate" / "manifest.json").is_file()
    assert _tracking_warnings(caplog) == [
        f"tracking: MLflow at {closed} failed: cannot be reached ([Errno 111] Connection refused); the run goes on, "
        f"and the next stage's sync (or `llmpipe track {NAME}`) logs what is missing"]
    capsys.readouterr()
    assert cli.main(["track", NAME, "--artifacts-dir", str(run_dir.parent), "--tracking-uri", closed]) == 1
    assert capsys.readouterr().err == (f"error: tracking: MLflow at {closed} failed: cannot be reached "
                                       "([Errno 111] Connection refused)\n")
    assert cli.main(["promote", f"{NAME}/99", "--artifacts-dir", str(run_dir.parent)]) == 1
    assert capsys.readouterr().err == f"error: model version {NAME}/99 not found in {uri}\n"
    assert cli.main(["generate", "models:/nobody@production", "--artifacts-dir", str(run_dir.parent),
                     "--prompt", "x"]) == 1
    assert capsys.readouterr().err == f"error: model version nobody@production not found in {uri}\n"


def test_the_config_s_model_name_rule_is_mlflow_s_own():
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import _validate_model_name

    from llmpipe import config as config_mod
    from llmpipe.config_checks import check_tracking
    from llmpipe.errors import ConfigError

    for name in ["llama", "team llama-7b_v2", "a/b", "a:b", "..", ".", "./x", "x/", " ", "a..b", "x.", "ünï"]:
        try:
            _validate_model_name(name)
            mlflow_ok = True
        except MlflowException:
            mlflow_ok = False
        try:
            check_tracking(config_mod.MlflowSection(model_name=name))
            ours = True
        except ConfigError:
            ours = False
        assert ours == mlflow_ok, name
