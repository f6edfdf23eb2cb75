"""A model larger than one rank should hold: FSDP2 and ZeRO-3 build a >= 1 GB (fp32) model on 2 ranks
allocating only their shards, and each rank's peak RSS over the build and two training steps stays
within 15% of the planner's prediction (sharded states + gathered units + activations + buffers, or
the optimizer step's temporaries); DDP, on the same model, needs the full states on every rank
(benchmarks/build_memory.py; measured here with the fused CPU AdamW: FSDP2 -0.4%, ZeRO-3 -0.2%, DDP +8%
of plan. DDP's 0.26-0.36 GiB over is not planned: about one embedding-sized gradient (0.24 GiB), likely autograd's
gradient before DDP copies it into its bucket; foreach's larger step temporaries used to hide it)."""

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
    # ZeRO-3 in fp32 keeps DeepSpeed's own fp32 master (20 B/param over 2 ranks, not 16) and 12 B per local
    # parameter of step temporaries, so on 2 ranks its peak is only a little below DDP's (fused CPU AdamW)
    assert rows["fsdp"]["peak"] < 0.9 * rows["ddp"]["peak"], rows
    assert rows["zero3"]["peak"] < rows["ddp"]["peak"], rows
    assert rows["ddp"]["peak"] >= rows["ddp"]["full"]  # DDP holds the whole model's states on every rank
    assert rows["fsdp"]["build"] < rows["ddp"]["build"]  # built sharded, not whole then sharded
