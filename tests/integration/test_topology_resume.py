"""Topology-free resume: a checkpoint written under one layout resumes under another (resharded by
llmpipe.checkpoint.portable), and the steps after the switch are those the first layout would have
taken: per-step losses within 1e-5 (fp32) and the final weights within rtol 1e-5."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint.consolidate import CONSOLIDATORS
from tests.conftest import cached_runs, losses, make_cfg, torchrun

pytestmark = pytest.mark.slow

STEPS, SWITCH = 8, 4
BASE = {"model": {"flavor": "debug", "n_layers": 4}, "train__max_steps": STEPS,
        "train__checkpoint": {"every_steps": SWITCH, "keep_last": 5}, "train__eval": {"every_steps": 100, "samples": 8}}
# name -> (processes, sections): 8 sequences per step under every layout
LAYOUTS = {
    "ddp2": (2, {"train__micro_batch_size": 4}),
    "fsdp1": (1, {"train__micro_batch_size": 8, "train__parallel": {"data": "fsdp"}}),
    "tp2": (2, {"train__micro_batch_size": 8, "train__parallel": {"tp": 2}}),
    "pp2": (2, {"train__micro_batch_size": 8, "train__parallel": {"pp": 2, "microbatches": 2}}),
    "zero3-2": (2, {"train__micro_batch_size": 4, "train__parallel": {"data": "zero", "zero_stage": 3}}),
    "ddp1": (1, {"train__micro_batch_size": 8}),
    "fsdp2": (2, {"train__micro_batch_size": 4, "train__parallel": {"data": "fsdp"}}),
    "zero2-2": (2, {"train__micro_batch_size": 4, "train__parallel": {"data": "zero", "zero_stage": 2}}),
    "zero3-1": (1, {"train__micro_batch_size": 8, "train__parallel": {"data": "zero", "zero_stage": 3}}),
}


SAME_STATE = {("ddp2", "fsdp1")}  # state format "dcp-nested" on both sides (llmpipe.checkpoint.state)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return cached_runs(tmp_path_factory, "topo", BASE)


def _weights(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    out.mkdir(parents=True, exist_ok=True)
    CONSOLIDATORS[ckpt.read_meta(checkpoint)["format"]](checkpoint, out, "fp32")
    return load_file(str(out / "model.safetensors"))


@pytest.mark.parametrize("a,b", [("ddp2", "fsdp1"), ("ddp2", "tp2"), ("pp2", "ddp2"), ("zero3-2", "ddp1"),
                                 ("fsdp2", "zero2-2"), ("ddp2", "zero3-2"),
                                 ("zero3-2", "zero3-1")])
def test_a_checkpoint_resumes_under_another_layout(runs, tmp_path, a, b):
    nproc_a, sections_a = LAYOUTS[a]
    first = runs(a, nproc=nproc_a, **sections_a)  # uninterrupted: the reference
    switch = ckpt.step_dir(first / "checkpoints", SWITCH)
    nproc_b, sections_b = LAYOUTS[b]
    second = tmp_path / "second"
    cfg = make_cfg(second, **{**BASE, **sections_b, "train__checkpoint": {**BASE["train__checkpoint"],
                                                                           "resume": str(switch)}})
    code, text = torchrun(cfg, runs.data, second, nproc=nproc_b)
    assert code == 0, text[-3000:]
    # the portable path, not the layout's own reader; but DDP and FSDP2 keep the same DCP state (keyed as
    # torch nests it), and FSDP2's own reader reshards DDP's checkpoint in DCP itself
    assert ("resharded" in text) == ((a, b) not in SAME_STATE)
    assert json.loads((second / "summary.json").read_text())["resumed_from"] == SWITCH
    torch.testing.assert_close(losses(second), losses(first)[SWITCH:], rtol=0, atol=1e-5)
    got = _weights(ckpt.step_dir(second / "checkpoints", STEPS), tmp_path / "got")
    want = _weights(ckpt.step_dir(first / "checkpoints", STEPS), tmp_path / "want")
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)
