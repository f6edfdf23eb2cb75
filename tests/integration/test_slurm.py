"""The train stage under a real Slurm (tests/slurm_host.py: munged, slurmctld and slurmd on this host):
two ranks train through sbatch, a requeued job resumes from the newest verified checkpoint, a cancelled
stage leaves no job in squeue, and a partition that does not exist or an artifacts folder the nodes do
not share is one line before anything trains. Skipped, saying why, where Slurm is not installed."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from llmpipe import config as config_mod
from llmpipe import preflight, stages
from llmpipe.errors import ConfigError, StageError
from llmpipe.train import cluster
from tests import slurm_host
from tests.integration.test_faults import _config, _wait_for_step

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.skipif(slurm_host.missing() is not None,
                                                   reason=slurm_host.missing() or "")]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory, request):
    """A one-node Slurm (CPUs=2) for this module; its clients find it through SLURM_CONF."""
    local = slurm_host.LocalSlurm(tmp_path_factory.mktemp("slurm")).start()
    old = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = local.env["SLURM_CONF"]
    yield local
    local.stop()
    if old is None:
        os.environ.pop("SLURM_CONF", None)
    else:
        os.environ["SLURM_CONF"] = old


@pytest.fixture(autouse=True)
def _no_job_left(slurm):
    """Each test starts with an empty queue whatever the one before it left (a job holds the node)."""
    yield
    slurm.cancel_all()


def _slurm_config(tmp_path: Path, name: str, **cluster_settings) -> Path:
    """test_faults' tiny two-rank run with launcher slurm; `cluster_settings` override train.cluster."""
    path = _config(tmp_path, name)
    tree = yaml.safe_load(path.read_text())
    tree["train"].update({"max_steps": 40, "checkpoint": {"every_steps": 4, "keep_last": 20}, "launcher": "slurm",
                          "cluster": {"accelerator": "cpu", "poll_s": 0.3, "time": "10",
                                      "partition": slurm_host.PARTITION, **cluster_settings}})
    path.write_text(yaml.safe_dump(tree))
    return path


def _record(cfg) -> dict:
    partial = stages.partial_dir(cfg.run_dir(), "train")
    return json.loads((partial / cluster.FOLDER / cluster.RECORD).read_text())


def _wait_for(predicate, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {timeout}s")


def test_a_requeued_slurm_job_resumes_from_the_newest_verified_checkpoint_and_the_stage_ends_with_it(
        slurm, tmp_path, caplog):
    cfg = config_mod.load(_slurm_config(tmp_path, "requeue"))
    stages.run_stage("prepare_data", cfg)
    result: dict = {}

    def train() -> None:
        try:
            result["manifest"] = stages.run_stage("train", cfg)[0]
        except BaseException as err:  # handed to the test's thread
            result["error"] = err

    caplog.set_level(logging.INFO, logger="llmpipe")
    stage = threading.Thread(target=train)
    stage.start()
    partial = stages.partial_dir(cfg.run_dir(), "train")
    _wait_for_step(partial / "metrics.jsonl", 9)  # checkpoints at steps 4 and 8 are written
    job_id = _record(cfg)["job_id"]
    subprocess.run(["scontrol", "requeue", job_id], check=True, env=slurm.env)
    stage.join(timeout=240)
    assert not stage.is_alive() and "error" not in result, result.get("error")
    assert f"Slurm job {job_id} runs again (requeued)" in caplog.text
    manifest = result["manifest"]
    assert manifest.metrics["slurm_job"] == job_id and manifest.metrics["requeued"] == 1
    assert manifest.metrics["resumed_from"] >= 8 and manifest.metrics["resumed_from"] % 4 == 0
    script = (stages.stage_dir(cfg.run_dir(), "train") / cluster.FOLDER / "job.sbatch").read_text()
    assert "#SBATCH --requeue" in script and "#SBATCH --partition=debug" in script
    assert slurm.squeue() == []


def _stage_cli(path: Path) -> subprocess.Popen:
    # SIGINT back to its default in the child: a suite started in the background ignores it, children inherit
    # that, and the test's Ctrl-C would reach a stage that rightly ignores it (tests/flows/test_signals.py)
    return subprocess.Popen([sys.executable, "-m", "llmpipe", "stage", "train", str(path)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def test_a_killed_stage_s_job_is_taken_up_by_the_next_attempt_and_ctrl_c_leaves_nothing_in_squeue(slurm, tmp_path):
    path = _slurm_config(tmp_path, "cancel")
    tree = yaml.safe_load(path.read_text())
    tree["train"]["max_steps"] = 100_000  # still training when the test is done with it
    path.write_text(yaml.safe_dump(tree))
    cfg = config_mod.load(path)
    stages.run_stage("prepare_data", cfg)
    first = _stage_cli(path)
    partial = stages.partial_dir(cfg.run_dir(), "train")
    _wait_for(lambda: (partial / cluster.FOLDER / cluster.RECORD).is_file(), "the job's submission")
    job_id = _record(cfg)["job_id"]
    _wait_for(lambda: any(line.startswith(f"{job_id} RUNNING") for line in slurm.squeue()), "the job running")
    first.kill()  # no chance to cancel: the job runs on
    first.communicate(timeout=60)
    assert [line.split()[0] for line in slurm.squeue()] == [job_id]

    second = _stage_cli(path)  # follows that job rather than submitting another
    seen = []
    for line in second.stdout:  # up to the line that says so
        seen.append(line)
        if f"following Slurm job {job_id}, submitted by an earlier attempt and still queued" in line:
            break
    else:
        raise AssertionError("".join(seen[-30:]))
    second.send_signal(signal.SIGINT)  # Ctrl-C
    output, _ = second.communicate(timeout=120)
    assert second.returncode != 0
    assert f"cancelling Slurm job {job_id}" in output, output[-2000:]
    assert "submitted Slurm job" not in "".join(seen) + output
    assert slurm.squeue() == []


def test_a_partition_that_does_not_exist_is_one_line_before_anything_trains(slurm, tmp_path):
    cfg = config_mod.load(_slurm_config(tmp_path, "partition", partition="gpu-h100"))
    with pytest.raises(ConfigError) as info:
        preflight.check_before_run(cfg, ["prepare_data", "train"], force=False, source="cfg.yaml")
    assert str(info.value) == ("cfg.yaml: train.cluster.partition: 'gpu-h100' is not a partition of this cluster "
                               "(sinfo: debug)")


def test_an_artifacts_folder_the_nodes_do_not_share_is_one_line_and_the_job_is_cancelled(slurm, tmp_path):
    # the nodes see the run folder at shared_dir: another folder than the stage's, laid out the same
    elsewhere = tmp_path / "elsewhere"
    cfg = config_mod.load(_slurm_config(tmp_path, "unshared", shared_dir=str(elsewhere), marker_timeout_s=5))
    stages.run_stage("prepare_data", cfg)
    partial = stages.partial_dir(cfg.run_dir(), "train")
    (elsewhere / "unshared" / partial.name / cluster.FOLDER).mkdir(parents=True)  # where sbatch writes its output
    with pytest.raises(StageError) as info:
        stages.run_stage("train", cfg)
    assert str(info.value) == (f"train.cluster.shared_dir: node(s) 0 of 1 wrote no marker into "
                               f"{elsewhere}/unshared/{partial.name} within 5 s: the artifacts folder is not shared "
                               "with every node (set train.cluster.shared_dir to its path on the nodes)")
    assert not list((elsewhere / "unshared" / partial.name).glob("checkpoints/*"))  # nothing trained
    assert slurm.squeue() == []
