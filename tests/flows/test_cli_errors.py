"""`llmpipe run` reports a failed stage as the same single `error:` line as `llmpipe stage`, with
Prefect's tracebacks kept out of the terminal (they stay in the Prefect log; --verbose shows them)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.flows.test_pipeline import _write_config

pytestmark = pytest.mark.slow
LLMPIPE = str(Path(sys.executable).with_name("llmpipe"))


def test_a_failed_stage_through_llmpipe_run_is_one_error_line_without_tracebacks(tmp_path):
    config = _write_config(tmp_path)
    env = {**os.environ, "LLMPIPE_FAIL_STAGE": "prepare_data"}
    env.pop("PREFECT_LOGGING_LEVEL", None)  # the default level, as a user has it
    out = subprocess.run([LLMPIPE, "run", str(config)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    errors = [ln for ln in out.stderr.splitlines() if ln.startswith("error:")]
    assert errors == ["error: prepare_data: failure injected by LLMPIPE_FAIL_STAGE (a test hook)"]
    assert "Traceback" not in out.stderr and "Encountered exception" not in out.stderr, out.stderr[-3000:]
