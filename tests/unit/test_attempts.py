"""Failed attempts keep their evidence (bounded), the error line points at what exists, and a
resumable stage's folder with another fingerprint is moved aside, never deleted."""

from __future__ import annotations

import re

import pytest

from llmpipe import attempts, stages
from tests.unit.test_stages import _cfg


def _failing_stage(monkeypatch, log_text: str = "E19999: the ATC said no\n"):
    """convert_om replaced by a function that writes a log and fails naming it, as ATC's runner does."""
    def run(ctx):
        (ctx.work_dir / "atc.log").write_text(log_text)
        (ctx.work_dir / "model.om").write_bytes(b"\0" * 100)  # a result, not evidence
        raise stages.StageError(f"ATC failed: E19999 (log: {ctx.work_dir / 'atc.log'}).")

    monkeypatch.setattr(stages, "_resolve", lambda entry: run if entry.endswith("atc:run") else _real(entry))


_real = stages._resolve


def test_a_failed_stage_keeps_its_logs_under_failed_and_the_error_names_the_kept_copy(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    run_dir = cfg.run_dir()
    run_dir.mkdir(parents=True)
    _failing_stage(monkeypatch)
    with pytest.raises(stages.StageError) as err:
        stages._execute(stages.SPECS["convert_om"], cfg, stages.fingerprints(cfg), {})
    message = str(err.value)
    path = re.search(r"log: (\S+?)\)", message).group(1)
    assert "/failed/05_convert_om-" in path and open(path).read() == "E19999: the ATC said no\n"
    kept = attempts.kept(run_dir, attempts.FAILED, "05_convert_om")
    assert len(kept) == 1 and sorted(p.name for p in kept[0].path.iterdir()) == ["atc.log", "error.txt"]
    assert not (run_dir / ".05_convert_om.partial").exists()  # nothing half-written stays
    assert attempts.last_failure(run_dir, "05_convert_om")[1].startswith("StageError: ATC failed: E19999")


def test_failed_evidence_is_bounded_per_stage(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    cfg.run_dir().mkdir(parents=True)
    _failing_stage(monkeypatch)
    for _ in range(attempts.FAILED_KEEP + 2):
        with pytest.raises(stages.StageError):
            stages._execute(stages.SPECS["convert_om"], cfg, stages.fingerprints(cfg), {})
    assert len(attempts.kept(cfg.run_dir(), attempts.FAILED, "05_convert_om")) == attempts.FAILED_KEEP


def test_a_resumable_partial_folder_with_another_fingerprint_is_moved_aside(tmp_path):
    run_dir = tmp_path / "run"
    partial = run_dir / ".02_train.partial"
    (partial / "checkpoints" / "step-000010").mkdir(parents=True)
    (partial / "checkpoints" / "step-000010" / "meta.json").write_text("{}")
    (partial / ".fingerprint").write_text("a" * 64 + "\n")
    stages._prepare_partial(partial, "b" * 64, stages.SPECS["train"], run_dir)
    (kept,) = attempts.kept(run_dir, attempts.SUPERSEDED)
    assert kept.fingerprint == "a" * 12 and (kept.path / "checkpoints" / "step-000010" / "meta.json").is_file()
    assert sorted(p.name for p in partial.iterdir()) == [".fingerprint"]
    assert attempts.prune_superseded(run_dir, "02_train", None) == []  # retention unset keeps all
    assert attempts.prune_superseded(run_dir, "02_train", 0) == [kept.path] and not kept.path.exists()


def test_repoint_leaves_paths_that_were_not_kept():
    from pathlib import Path

    work, kept = Path("/x/.02_train.partial"), Path("/nonexistent/failed/02_train-1")
    assert attempts.repoint(f"see {work}/checkpoints/step-1.", work, kept) == f"see {work}/checkpoints/step-1."



def test_an_error_file_of_invalid_utf8_or_huge_still_gives_its_first_line(tmp_path):
    kept = tmp_path / "run" / attempts.FAILED / "05_convert_om-20240101T000000Z"
    kept.mkdir(parents=True)
    (kept / attempts.ERROR_FILE).write_bytes(b"StageError: bad \xff byte\n" + b"x" * (64 << 20))
    assert attempts.last_failure(tmp_path / "run", "05_convert_om")[1] == "StageError: bad \ufffd byte"
