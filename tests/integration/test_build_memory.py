"""A model larger than one rank should hold: FSDP2 and ZeRO-3 build a >= 1 GB (fp32) model on 2 ranks
allocating only their shards, and each rank's peak RSS over the build and two training steps stays
within 15% of the planner's prediction (sharded states + gathered units + activations + buffers, or
the optimizer step's temporaries); DDP, on the same model, needs the full states on every rank
(benchmarks/build_memory.py; measured here: FSDP2 -1%, ZeRO-3 +3%, DDP +2% of plan)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.slow


def test_sharded_layouts_build_and_train_a_1gb_model_within_the_planned_memory():
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "build_memory.py"), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    rows = {r["layout"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert 4 * rows["fsdp"]["params"] >= 1e9  # at least 1 GB of fp32 parameters
    for layout in ("fsdp", "zero3", "ddp"):
        assert abs(rows[layout]["error"]) <= 0.15, rows[layout]
    for layout in ("fsdp", "zero3"):
        assert rows[layout]["states"] <= 0.65 * rows[layout]["full"]  # sharded: about 1/2 of the states
        assert rows[layout]["peak"] < 0.9 * rows["ddp"]["peak"], (layout, rows)
    assert rows["ddp"]["peak"] >= rows["ddp"]["full"]  # DDP holds the whole model's states on every rank
    assert rows["fsdp"]["build"] < rows["ddp"]["build"]  # built sharded, not whole then sharded
