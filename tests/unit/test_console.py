"""What `llmpipe run` shows on the terminal without --verbose (llmpipe.console), and that the stage log gets
everything, including what a library writes to stderr."""

from __future__ import annotations

import io
import logging
import sys

import pytest

from llmpipe import console


def _record(name: str, level: int, msg: str, **extra) -> logging.LogRecord:
    record = logging.LogRecord(name, level, __file__, 1, msg, (), None)
    record.__dict__.update(extra)
    return record


@pytest.mark.parametrize("name,level,msg,extra,shown", [
    ("llmpipe.stages", logging.INFO, "train: running (fingerprint 0123)", {console.CONSOLE: True}, True),
    ("llmpipe.stages", logging.INFO, "train: completed in 1.0s", {}, False),
    ("llmpipe.export.atc", logging.WARNING, "convert_om skipped: ATC not found", {}, True),
    ("prefect.task_runs", logging.INFO, "Finished in state Completed()", {}, False),
    ("prefect.flow_runs", logging.ERROR, "Finished in state Failed('boom')", {}, False),  # the CLI's error: line
    ("lm_eval.api.task", logging.WARNING, "metric word_perplexity is defined, but aggregation is not", {}, False),
    ("urllib3", logging.ERROR, "connection refused", {}, True),
])
def test_the_terminal_shows_marked_lines_llmpipe_warnings_and_foreign_errors_only(name, level, msg, extra, shown):
    assert console.ConsoleFilter().filter(_record(name, level, msg, **extra)) is shown


def test_a_stage_log_holds_every_record_and_on_a_quiet_console_what_libraries_write_to_stderr(tmp_path, monkeypatch):
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(console, "_TERMINAL", terminal)  # as quiet_console() leaves it
    root, path = logging.getLogger(), tmp_path / "logs" / "07_evaluate.log"
    level = root.level
    root.setLevel(logging.INFO)  # as the CLI sets it (LLMPIPE_LOG_LEVEL)
    try:
        with console.log_to(path):
            logging.getLogger("lm_eval.evaluator").info("Building contexts for llmpipe_ppl on rank 0...")
            print("Running loglikelihood requests: 100%", file=sys.stderr)
            assert console.terminal() is terminal  # where bars still go
        logging.getLogger("lm_eval.evaluator").info("after the stage")
    finally:
        root.setLevel(level)
    text = path.read_text()
    assert "INFO lm_eval.evaluator: Building contexts for llmpipe_ppl on rank 0..." in text
    assert "Running loglikelihood requests: 100%" in text and "after the stage" not in text
    assert terminal.getvalue() == "" and sys.stderr is terminal


def test_the_one_line_results_read_the_stage_metrics():
    assert console.summary("train", {"steps": 150, "val_loss_start": 8.31, "val_loss": 4.6, "val_ppl": 99.5,
                                     "tokens_per_s": 7059.2}) == \
        "150 steps, val loss 8.310 -> 4.600 (ppl 99.5), 7,059 tokens/s"
    assert console.summary("evaluate", {"verdicts": {"fp32": "accepted", "int8": "rejected"}}) == \
        "gates: fp32 accepted, int8 rejected"
    assert console.summary("benchmark", {"decode_tokens_per_s": {"cpu/fp32": 186.7, "cpu/int8": 508.2},
                                         "rejected": ["int4"]}) == "decode tokens/s: fp32 187, int8 508; rejected: int4"
    assert console.summary("convert_om", {"graphs": {}}) == ""
