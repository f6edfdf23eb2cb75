"""superseded/ and failed/ are never written or deleted through a symlink: `clean`, retention and the
failed attempts' rotation delete nothing outside the run folder, unlink a symlink inside and leave its
target alone, and `clean` prints each removal as it is done. Folders are made by hand: no training."""

from __future__ import annotations

import logging
import os

import pytest

from llmpipe import attempts, cli, stages
from tests.unit.test_stages import _cfg

OLD, NEW = "02_train-aaaaaaaaaaaa-20240101T000000Z", "02_train-bbbbbbbbbbbb-20240202T000000Z"


def _kept(root, name, size=1000):
    (root / name / "checkpoints").mkdir(parents=True)
    (root / name / "checkpoints" / "model.pt").write_bytes(b"\0" * size)
    return root / name


def _clean(tmp_path, *extra):
    return cli.main(["clean", "r", "--artifacts-dir", str(tmp_path / "artifacts"), *extra])


@pytest.fixture
def run_dir(tmp_path):
    (tmp_path / "artifacts" / "r").mkdir(parents=True)
    return tmp_path / "artifacts" / "r"


def _link(path, target):
    os.symlink(target, path)
    return path


def test_clean_refuses_a_symlinked_superseded_folder_and_deletes_nothing_in_its_target(tmp_path, run_dir, capsys):
    outside = _kept(tmp_path / "elsewhere", OLD)
    link = _link(run_dir / "superseded", tmp_path / "elsewhere")
    assert _clean(tmp_path, "--keep", "0") == 1
    assert capsys.readouterr().err == (f"error: {link} is a symlink (to {tmp_path / 'elsewhere'}); superseded/ must "
                                       "be a plain folder inside the run folder: nothing is written or deleted "
                                       "through a link\n")
    assert (outside / "checkpoints" / "model.pt").is_file()


def test_clean_refuses_a_symlinked_failed_folder_before_removing_anything(tmp_path, run_dir, capsys):
    kept = _kept(run_dir / "superseded", OLD)
    (tmp_path / "elsewhere").mkdir()
    _link(run_dir / "failed", tmp_path / "elsewhere")
    assert _clean(tmp_path) == 1
    assert capsys.readouterr().err.startswith(f"error: {run_dir / 'failed'} is a symlink (to ")
    assert kept.is_dir()


def test_clean_unlinks_a_symlink_inside_superseded_leaves_its_target_and_counts_it(tmp_path, run_dir, capsys):
    kept = _kept(run_dir / "superseded", NEW, size=3 << 20)
    target = _kept(tmp_path / "elsewhere", OLD)
    link = _link(run_dir / "superseded" / OLD, target)
    assert _clean(tmp_path) == 0
    assert capsys.readouterr().out == (f"removed {kept}\n"
                                       f"removed {link} (a symlink; its target {target} left alone)\n"
                                       "clean: 2 superseded folder(s) removed, 3.0 MiB freed\n")
    assert not kept.exists() and not os.path.lexists(link) and (target / "checkpoints" / "model.pt").is_file()


def test_clean_reports_each_removal_before_making_the_next(run_dir):
    newer, older = _kept(run_dir / "superseded", NEW), _kept(run_dir / "superseded", OLD)
    seen = []
    removed = attempts.clean(run_dir, done=lambda r: seen.append((r.path, r.path.exists(), older.exists())))
    assert seen == [(newer, False, True), (older, False, False)]  # the newer went first, older still there
    assert [r.path for r in removed] == [newer, older] and [r.bytes for r in removed] == [1000, 1000]


def test_clean_works_in_a_run_folder_that_is_itself_a_symlink(tmp_path, capsys):
    """The user's choice (artifacts on another disk): the run folder's real path is the run's."""
    real = tmp_path / "disk2" / "r"
    kept = _kept(real / "superseded", OLD)
    (tmp_path / "artifacts").mkdir()
    _link(tmp_path / "artifacts" / "r", real)
    assert _clean(tmp_path) == 0
    assert not kept.exists() and "clean: 1 superseded folder(s) removed" in capsys.readouterr().out


def test_retention_with_a_symlinked_superseded_folder_warns_and_deletes_nothing(tmp_path, run_dir, caplog):
    outside = _kept(tmp_path / "elsewhere", OLD)
    _link(run_dir / "superseded", tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, "llmpipe.stages"):
        assert attempts.prune_superseded(run_dir, "02_train", 0) == []
    assert outside.is_dir()
    assert caplog.messages == [f"retention of superseded 02_train folders skipped: {run_dir / 'superseded'} is a "
                               f"symlink (to {tmp_path / 'elsewhere'}); superseded/ must be a plain folder inside "
                               "the run folder: nothing is written or deleted through a link"]


def test_retention_unlinks_a_symlink_inside_superseded_and_leaves_its_target(tmp_path, run_dir):
    target = _kept(tmp_path / "elsewhere", OLD)
    (run_dir / "superseded").mkdir()
    link = _link(run_dir / "superseded" / OLD, target)
    assert attempts.prune_superseded(run_dir, "02_train", 0) == [link]
    assert not os.path.lexists(link) and (target / "checkpoints" / "model.pt").is_file()


def _train_that_writes_a_file(monkeypatch):
    real = stages._resolve

    def run(ctx):
        (ctx.work_dir / "out.txt").write_text("trained\n")
        return stages.StageResult(outputs={"out": "out.txt"})

    monkeypatch.setattr(stages, "_resolve", lambda entry: run if entry == stages.SPECS["train"].entry else real(entry))


def test_a_symlink_in_superseded_does_not_fail_a_finished_train_stage_under_retention(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, "train.checkpoint.keep_superseded=0")
    run_dir = cfg.run_dir()
    target = _kept(tmp_path / "elsewhere", OLD)
    (run_dir / "superseded").mkdir(parents=True)
    link = _link(run_dir / "superseded" / OLD, target)
    _train_that_writes_a_file(monkeypatch)
    manifest = stages._execute(stages.SPECS["train"], cfg, stages.fingerprints(cfg), {})
    assert manifest.status == "completed" and (run_dir / "02_train" / "out.txt").is_file()
    assert not os.path.lexists(link) and (target / "checkpoints" / "model.pt").is_file()


def test_supersede_refuses_a_symlinked_superseded_folder_and_moves_nothing_out(tmp_path):
    run_dir = tmp_path / "run"
    partial = run_dir / ".02_train.partial"
    (partial / "checkpoints").mkdir(parents=True)
    (partial / ".fingerprint").write_text("a" * 64 + "\n")
    (tmp_path / "elsewhere").mkdir()
    _link(run_dir / "superseded", tmp_path / "elsewhere")
    with pytest.raises(attempts.KeptFolderError, match=r"superseded is a symlink \(to "):
        stages._prepare_partial(partial, "b" * 64, stages.SPECS["train"], run_dir)
    assert (partial / "checkpoints").is_dir() and list((tmp_path / "elsewhere").iterdir()) == []


def test_a_failed_attempt_keeps_no_evidence_through_a_symlinked_failed_folder(tmp_path, caplog):
    work, run_dir = tmp_path / "run" / ".05_convert_om.partial", tmp_path / "run"
    work.mkdir(parents=True)
    (work / "atc.log").write_text("E19999\n")
    (tmp_path / "elsewhere").mkdir()
    _link(run_dir / "failed", tmp_path / "elsewhere")
    with caplog.at_level(logging.WARNING, "llmpipe.stages"):
        assert attempts.keep_failure(work, run_dir, "05_convert_om", RuntimeError("x")) is None
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert caplog.messages[0].startswith(f"kept no evidence of the failed attempt: {run_dir / 'failed'} is a symlink")


def test_the_failed_attempts_rotation_unlinks_a_symlink_and_leaves_its_target(tmp_path):
    work, run_dir = tmp_path / "run" / ".05_convert_om.partial", tmp_path / "run"
    work.mkdir(parents=True)
    (work / "atc.log").write_text("E19999\n")
    target = _kept(tmp_path / "elsewhere", "05_convert_om-20000101T000000Z")
    (run_dir / "failed").mkdir()
    link = _link(run_dir / "failed" / "05_convert_om-20000101T000000Z", target)  # the oldest
    for _ in range(attempts.FAILED_KEEP):
        assert attempts.keep_failure(work, run_dir, "05_convert_om", RuntimeError("x")) is not None
    assert not os.path.lexists(link) and (target / "checkpoints" / "model.pt").is_file()
    assert len(list((run_dir / "failed").iterdir())) == attempts.FAILED_KEEP


def test_a_stage_is_refused_before_any_work_when_superseded_is_a_symlink(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    run_dir = cfg.run_dir()
    run_dir.mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    _link(run_dir / "superseded", tmp_path / "elsewhere")
    fps, ran = stages.fingerprints(cfg), []
    monkeypatch.setattr(stages, "_resolve", lambda entry: ran.append)
    with pytest.raises(attempts.KeptFolderError, match=r"superseded is a symlink \(to "):
        stages._execute(stages.SPECS["train"], cfg, fps, {})
    assert ran == [] and not (run_dir / ".02_train.partial").exists()
