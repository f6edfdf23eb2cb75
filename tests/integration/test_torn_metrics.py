"""A training killed while writing metrics.jsonl leaves a torn last line; the resume drops it and
logs on (issue 22, item 3)."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import make_cfg, torchrun

pytestmark = pytest.mark.slow


def test_a_training_resumes_past_a_torn_last_metrics_line(tmp_path, data_dir):
    cfg, out = make_cfg(tmp_path), tmp_path / "out"
    code, text = torchrun(cfg, data_dir, out, nproc=1)
    assert code == 0, text[-3000:]
    shutil.rmtree(out / "checkpoints" / "step-000006")  # killed during step 5: step 3's checkpoint is the newest
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    first = {json.loads(x)["step"]: x for x in lines if '"loss"' in x}
    metrics.write_text("".join(x for x in lines if json.loads(x)["step"] <= 4) + first[5][:30])
    code, text = torchrun(cfg, data_dir, out, nproc=1)
    assert code == 0, text[-3000:]
    records = [json.loads(x) for x in metrics.read_text().splitlines()]  # every line a record again
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3, 4, 5, 6]
