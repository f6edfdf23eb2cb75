"""A torn last line in metrics.jsonl (what a kill or a full disk leaves) is skipped by readers and
truncated by a resumed writer; it never stops a resume or the report (issue 22, item 3)."""

from __future__ import annotations

import json

from llmpipe import stages
from llmpipe.manifest import Manifest
from llmpipe.tools import report
from llmpipe.train import metrics
from llmpipe.train.metrics import METRICS, MetricsWriter
from tests.unit.test_stages import _cfg

TORN = '{"step": 7, "loss": 4.1'  # the write stopped here: no closing brace, no newline


def _log(folder, steps, tail=""):
    folder.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": s, "loss": 5.0 - 0.1 * s}) + "\n" for s in steps]
    (folder / METRICS).write_text("".join(lines) + tail)
    return folder / METRICS


def test_a_resume_after_a_torn_last_line_truncates_it_and_logs_on(tmp_path):
    path = _log(tmp_path, range(1, 7), TORN)
    writer = MetricsWriter(tmp_path, enabled=True, resume_step=5)
    writer.step({"step": 6, "loss": 4.4})
    writer.close()
    assert path.read_text().splitlines() == [json.dumps({"step": s, "loss": 5.0 - 0.1 * s}) for s in range(1, 6)] \
        + [json.dumps({"step": 6, "loss": 4.4})]


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = _log(tmp_path, range(1, 7), TORN)
    assert [r["step"] for r in metrics.read(path)] == [1, 2, 3, 4, 5, 6]
    assert f"{path}: skipped 1 line(s) that are not metrics records (a torn last line): line 7" in caplog.text


def test_a_damaged_middle_line_is_skipped_and_counted(tmp_path, caplog):
    path = _log(tmp_path, range(1, 4))
    path.write_text(path.read_text() + "\0\0\0\n[1, 2]\n" + json.dumps({"step": 4, "loss": 1.0}) + "\n")
    assert [r["step"] for r in metrics.read(path)] == [1, 2, 3, 4]
    assert f"{path}: skipped 2 line(s) that are not metrics records: line 4, 5" in caplog.text


def test_the_report_draws_the_loss_curve_past_a_torn_last_line(tmp_path):
    cfg = _cfg(tmp_path)
    folder = stages.stage_dir(cfg.run_dir(), "train")
    _log(folder, range(1, 7), TORN)
    Manifest(stage="train", status="completed", fingerprint="0" * 64, metrics={"steps": 7}).write(folder)
    page = report.write(cfg).read_text()
    assert '<img alt="loss curve" src="data:image/png;base64,' in page
