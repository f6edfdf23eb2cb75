"""Asynchronous checkpoints (train.checkpoint.async_save, DCP async_save) on 2 FSDP2 gloo ranks,
2 steps with a checkpoint after each: both verify and list every rank's files (each hashed by the
rank that wrote it), retention removed step 1 only after step 2 verified, and metrics.jsonl records
the training stall of each save."""

from __future__ import annotations

import json

import pytest

from llmpipe.checkpoint import io as ckpt
from llmpipe.train import metrics
from tests.conftest import cached_runs

pytestmark = pytest.mark.slow


def test_async_fsdp_checkpoints_verify_and_record_the_stall(tmp_path_factory):
    runs = cached_runs(tmp_path_factory, "async", {"train__micro_batch_size": 4, "train__max_steps": 2})
    out = runs("fsdp2", nproc=2, train__parallel={"data": "fsdp"},
               train__checkpoint={"every_steps": 1, "keep_last": 1, "async_save": True},
               train__eval={"every_steps": 1_000, "samples": 4})
    root = out / "checkpoints"
    assert [p.name for p in ckpt.list_steps(root)] == ["step-000002"]
    assert ckpt.latest_valid(root) == ckpt.step_dir(root, 2)
    files = ckpt.read_meta(ckpt.step_dir(root, 2))["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "trainer_state.pt"} <= set(files)
    saves = [r for r in metrics.read(out / "metrics.jsonl") if "checkpoint_stall_s" in r]
    assert [(r["step"], r["checkpoint_async"]) for r in saves] == [(1, 1), (2, 1)]
    assert all(r["checkpoint_stall_s"] >= 0 for r in saves)
    assert json.loads((out / "summary.json").read_text())["steps"] == 2
