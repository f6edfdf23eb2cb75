"""Reruns never lose training work: operational changes re-run nothing, a changed result field
warm-starts from the previous attempt's checkpoint (which is kept, never deleted), a failed run
resumes under a changed layout, and a wsd run extended to a longer horizon equals the longer run."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from llmpipe import attempts, cli, stages
from llmpipe import config as config_mod
from llmpipe.checkpoint import io as ckpt
from tests.conftest import checkpoint_weights
from tests.integration.test_faults import _rank_pid, _stage, _wait_for_step

pytestmark = pytest.mark.slow


def _config(tmp_path: Path, name: str, **train) -> Path:
    corpus = tmp_path / "corpus"
    if not corpus.exists():
        corpus.mkdir()
        for i in range(12):
            (corpus / f"d{i}.txt").write_text(" ".join(f"word{(i * 7 + j) % 50}" for j in range(600)))
    t = {"nproc_per_node": 2, "micro_batch_size": 4, "grad_accum_steps": 1, "max_steps": 6, "threads_per_proc": 1,
         "log_every": 1, "checkpoint": {"every_steps": 3, "keep_last": 10}, "eval": {"every_steps": 100, "batches": 1},
         "schedule": {"warmup_steps": 2}}
    for k, v in train.items():
        t[k] = {**t[k], **v} if isinstance(v, dict) else v
    cfg = {"run": {"name": name, "artifacts_dir": str(tmp_path / "artifacts"), "device": "cpu", "seed": 5},
           "data": {"inputs": [str(corpus / "*.txt")], "seq_len": 32, "val_fraction": 0.2,
                    "tokenizer": {"vocab_size": 300}},
           "model": {"flavor": "debug"}, "train": t}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _load(path: Path, *overrides: str) -> config_mod.RunConfig:
    return config_mod.load(path, list(overrides))


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run_dir / "02_train" / "metrics.jsonl").read_text().splitlines())
            if "loss" in r]


def test_operational_changes_rerun_nothing_and_a_longer_run_warm_starts_keeping_the_old_one(tmp_path, capsys):
    path = _config(tmp_path, "ops")
    cfg = _load(path)
    for s in ("prepare_data", "train", "consolidate"):
        stages.run_stage(s, cfg)
    before = stages.fingerprints(cfg)

    # only operational fields changed: nothing runs, the change is recorded in the manifest
    ops = _load(path, "train.log_every=5", "train.dist_timeout_s=900", "train.checkpoint.keep_last=4")
    assert stages.fingerprints(ops) == before
    for s in ("prepare_data", "train", "consolidate"):
        manifest, executed = stages.run_stage(s, ops)
        assert not executed, s
    recorded = json.loads((cfg.run_dir() / "02_train" / "manifest.json").read_text())
    assert recorded["changes"][-1]["operational"] == {"train.log_every": [1, 5], "train.dist_timeout_s": [1800, 900],
                                                     "train.checkpoint.keep_last": [10, 4]}
    assert recorded["config"]["train"]["log_every"] == 5

    # max_steps 6 -> 9: a new attempt, warm-started at step 6; the old folder is kept, not deleted
    longer = _load(path, "train.max_steps=9")
    manifest, executed = stages.run_stage("train", longer)
    assert executed and manifest.metrics["resumed_from"] == 6
    warm = manifest.metrics["warm_start"]
    assert warm["step"] == 6 and warm["changed"]["train.max_steps"] == [6, 9]
    assert "optimizer state" in warm["carried_over"]
    assert _steps(cfg.run_dir()) == [7, 8, 9]
    (old,) = attempts.kept(cfg.run_dir(), attempts.SUPERSEDED, "02_train")
    assert old.fingerprint == before["train"][:12]
    assert ckpt.verify(old.path / "checkpoints" / "step-000006") is None  # still there, still valid
    assert stages.state(longer, "consolidate")[0] == "stale"  # new weights: downstream follows

    # only the lr changes on the finished 9-step run: its own checkpoint is at step 9, nothing left to
    # train from there, so the attempt before it (kept under superseded/) seeds it at step 6
    manifest, executed = stages.run_stage("train", _load(path, "train.max_steps=9", "train.optim.lr=1e-3"))
    warm = manifest.metrics["warm_start"]
    assert executed and warm["step"] == 6 and warm["source"] == str(old.path)
    assert warm["changed"]["train.optim.lr"] == [3e-4, 1e-3]
    newer, oldest = attempts.kept(cfg.run_dir(), attempts.SUPERSEDED, "02_train")
    assert oldest.path == old.path  # newest first

    assert cli.main(["status", "ops", "--artifacts-dir", str(tmp_path / "artifacts")]) == 0
    out = capsys.readouterr().out
    assert "superseded (kept; `llmpipe clean ops` removes them): 2 folder(s)" in out and old.path.name in out
    assert cli.main(["clean", "ops", "--artifacts-dir", str(tmp_path / "artifacts"), "--keep", "1"]) == 0
    assert newer.path.is_dir() and not old.path.exists()  # --keep 1 keeps the newest
    assert cli.main(["clean", "ops", "--artifacts-dir", str(tmp_path / "artifacts")]) == 0
    assert not newer.path.exists() and "1 superseded folder(s) removed" in capsys.readouterr().out


def test_a_failed_run_resumes_on_one_process_after_losing_one_and_deletes_nothing(tmp_path):
    path = _config(tmp_path, "lost", max_steps=40, checkpoint={"keep_last": 20})
    cfg = _load(path)
    stages.run_stage("prepare_data", cfg)
    partial = cfg.run_dir() / ".02_train.partial"
    proc = _stage(["stage", "train", str(path)])
    _wait_for_step(partial / "metrics.jsonl", 7)
    os.kill(_rank_pid(partial, 1), signal.SIGKILL)  # a node is lost
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    written = {p.name for p in ckpt.list_steps(partial / "checkpoints")}  # not a half-written .tmp
    resume_at = ckpt.read_meta(ckpt.latest_valid(partial / "checkpoints"))["step"]
    assert resume_at >= 6
    failed = attempts.last_failure(cfg.run_dir(), "02_train")
    assert failed is not None and (failed[0].path / "error.txt").is_file()
    assert any((failed[0].path / "torchrun-logs").rglob("*")) and failed[1].startswith("StageError")

    # one process now, same global batch (8 sequences): the same fingerprint, so it resumes in place;
    # a longer timeout (operational) changes nothing either
    one = _load(path, "train.nproc_per_node=1", "train.grad_accum_steps=2", "train.dist_timeout_s=900",
                "train.max_steps=9")
    assert stages.fingerprints(one)["train"] != stages.fingerprints(cfg)["train"]  # max_steps moved it
    one = _load(path, "train.nproc_per_node=1", "train.grad_accum_steps=2", "train.dist_timeout_s=900")
    assert stages.fingerprints(one)["train"] == stages.fingerprints(cfg)["train"]
    manifest, executed = stages.run_stage("train", one)
    assert executed and manifest.metrics["resumed_from"] == resume_at and manifest.metrics["world_size"] == 1
    kept = {p.name for p in (cfg.run_dir() / "02_train" / "checkpoints").iterdir()}
    assert written <= kept  # nothing the failed attempt wrote was deleted
    assert attempts.kept(cfg.run_dir(), attempts.SUPERSEDED) == []


def test_wsd_extension_from_the_stable_phase_equals_the_longer_run_planned_from_the_start(tmp_path):
    # keep_last 1: retention keeps the last stable-phase checkpoint as well (step 6 of the 8-step run)
    wsd = {"schedule": {"warmup_steps": 2, "decay": "wsd", "decay_fraction": 0.25}, "nproc_per_node": 1,
           "checkpoint": {"every_steps": 2, "keep_last": 1}}
    planned = _load(_config(tmp_path, "planned", max_steps=12, **wsd))
    for s in ("prepare_data", "train"):
        stages.run_stage(s, planned)
    short_path = _config(tmp_path, "extended", max_steps=8, **wsd)
    short = _load(short_path)
    (short.run_dir()).mkdir(parents=True)
    shutil.copytree(planned.run_dir() / "01_prepare_data", short.run_dir() / "01_prepare_data")  # same data
    assert stages.run_stage("prepare_data", short)[1] is False
    stages.run_stage("train", short)  # decays from step 6 (8 - ceil(0.25 x 8))
    assert [p.name for p in ckpt.list_steps(short.run_dir() / "02_train" / "checkpoints")] == \
        ["step-000006", "step-000008"]
    manifest, executed = stages.run_stage("train", _load(short_path, "train.max_steps=12"))
    assert executed and manifest.metrics["warm_start"]["step"] == 6  # the stable phase's last checkpoint
    a = checkpoint_weights(planned.run_dir() / "02_train" / "checkpoints" / "step-000012")
    b = checkpoint_weights(short.run_dir() / "02_train" / "checkpoints" / "step-000012")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)  # bitwise


def _weights(folder: Path) -> dict:
    return checkpoint_weights(folder)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """The config of a finished 6-step one-rank training whose only checkpoint is the final one."""
    tmp_path = tmp_path_factory.mktemp("finished")
    path = _config(tmp_path, "finished", nproc_per_node=1, checkpoint={"keep_last": 1})
    cfg = _load(path)
    for s in ("prepare_data", "train"):
        stages.run_stage(s, cfg)
    assert [p.name for p in ckpt.list_steps(cfg.run_dir() / "02_train" / "checkpoints")] == ["step-000006"]
    return path


def test_resuming_the_checkpoint_at_max_steps_publishes_it_without_training(finished):
    cfg = _load(finished)
    final = cfg.run_dir() / "02_train" / "checkpoints" / "step-000006"
    before = _weights(final)
    manifest, executed = stages.run_stage("train", _load(finished, f"train.checkpoint.resume={final}"), force=True)
    assert executed and manifest.metrics["resumed_from"] == 6
    assert _steps(cfg.run_dir()) == []  # not one step trained
    published = cfg.run_dir() / "02_train" / "checkpoints" / "step-000006"  # this attempt's, re-saved
    assert ckpt.verify(published) is None and _same(_weights(published), before)


def test_resuming_a_checkpoint_past_max_steps_is_one_line(finished, tmp_path):
    final = _load(finished).run_dir() / "02_train" / "checkpoints" / "step-000006"
    cfg = _load(finished, "run.name=shorter", "train.max_steps=4", f"train.checkpoint.resume={final}")
    cfg.run_dir().mkdir(parents=True)
    shutil.copytree(_load(finished).run_dir() / "01_prepare_data", cfg.run_dir() / "01_prepare_data")
    with pytest.raises(stages.StageError) as info:
        stages.run_stage("train", cfg)
    line = str(info.value)
    assert "\n" not in line and f"rank 0: train.checkpoint.resume: {final} is at step 6, past train.max_steps=4" \
        in line, line


def test_a_rerun_that_finds_its_own_result_without_a_manifest_publishes_it_without_training(tmp_path):
    path = _config(tmp_path, "lost", nproc_per_node=1, checkpoint={"keep_last": 1})
    cfg = _load(path)
    for s in ("prepare_data", "train"):
        stages.run_stage(s, cfg)
    before = _weights(cfg.run_dir() / "02_train" / "checkpoints" / "step-000006")
    (cfg.run_dir() / "02_train" / "manifest.json").unlink()  # lost: the stage is "missing" and runs again
    manifest, executed = stages.run_stage("train", cfg)
    assert executed and manifest.metrics["warm_start"]["step"] == 6 and manifest.metrics["resumed_from"] == 6
    assert _steps(cfg.run_dir()) == []  # the same fingerprint at max_steps: the result, not trained again
    assert _same(_weights(cfg.run_dir() / "02_train" / "checkpoints" / "step-000006"), before)
