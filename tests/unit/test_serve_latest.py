"""`llmpipe serve --latest-passing` (and the serve-latest deployment built on it): which run it picks."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmpipe.cli import main
from llmpipe.manifest import Manifest, file_entry
from llmpipe.stages import stage_dir
from llmpipe.tools.serve import ServeError, latest_passing


def _benchmarked(root: Path, name: str, finished: str, rejected: tuple[str, ...] = ()) -> Path:
    folder = stage_dir(root / name, "benchmark")
    folder.mkdir(parents=True)
    (folder / "results.json").write_text("{}")
    Manifest("benchmark", "completed", "fp", {"results": file_entry(folder, "results.json")},
             metrics={"rejected": list(rejected), "ppl": {"fp32": 10.0, "int8": 10.5}},
             finished_at=finished).write(folder)
    return root / name


def test_the_run_whose_benchmark_finished_last_with_the_variant_passing_is_picked(tmp_path):
    _benchmarked(tmp_path, "a", "2026-11-01T02:00:00+00:00")
    c = _benchmarked(tmp_path, "c", "2026-11-15T02:00:00+00:00")
    b = _benchmarked(tmp_path, "b", "2026-12-01T02:00:00+00:00", rejected=("int8",))
    (tmp_path / "untrained").mkdir()  # no benchmark: never a candidate
    assert latest_passing(tmp_path, "fp32") == b
    assert latest_passing(tmp_path, "int8") == c  # b's int8 failed its gate


def test_a_tampered_or_linked_run_is_never_picked(tmp_path):
    a = _benchmarked(tmp_path, "a", "2026-11-01T02:00:00+00:00")
    newer = _benchmarked(tmp_path / "elsewhere", "n", "2026-12-01T02:00:00+00:00")
    (tmp_path / "z-link").symlink_to(newer, target_is_directory=True)
    tampered = _benchmarked(tmp_path, "t", "2026-12-02T02:00:00+00:00")
    (stage_dir(tampered, "benchmark") / "results.json").write_text('{"edited": 1}')
    assert latest_passing(tmp_path, "fp32") == a


def test_no_passing_run_is_one_line(tmp_path, capsys):
    _benchmarked(tmp_path, "a", "2026-11-01T02:00:00+00:00", rejected=("fp32",))
    with pytest.raises(ServeError):
        latest_passing(tmp_path, "fp32")
    assert main(["serve", "--latest-passing", "--artifacts-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --latest-passing: no run under {tmp_path} has a completed benchmark that fp32 passed"]


@pytest.mark.parametrize("argv", [["serve"], ["serve", "tiny", "--latest-passing"]])
def test_serve_takes_a_run_or_latest_passing_not_both(argv, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == "error: serve: name a RUN or pass --latest-passing (one of the two)"
