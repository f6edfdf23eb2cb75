"""Checkpoints of the previous release still resume by their layout's own reader: its meta.json names the
format and the strategy class that wrote it and has no `state_format` (issue 23 item 1). Each format
(full from DDP, dcp from FSDP2 and from dp x tp x pp, deepspeed from ZeRO) is written, its meta.json put
back in the previous release's shape, and resumed: the steps after it are bitwise the uninterrupted run's."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from llmpipe.checkpoint import io as ckpt
from tests.conftest import cached_runs, full_checkpoint, losses, make_cfg, torchrun

pytestmark = pytest.mark.slow

STEPS, AT = 4, 2
BASE = {"model": {"flavor": "debug"}, "train__max_steps": STEPS, "train__micro_batch_size": 4,
        "train__checkpoint": {"every_steps": AT, "keep_last": 5}, "train__eval": {"every_steps": 100, "samples": 8}}
# name -> (processes, the class the previous release recorded, sections)
CASES = {
    "full": (1, "DDPStrategy", {}),
    "dcp-fsdp": (1, "FSDPStrategy", {"train__parallel": {"data": "fsdp"}}),
    "dcp-mesh": (2, "ModelParallelStrategy", {"train__parallel": {"tp": 2}}),
    "deepspeed": (1, "ZeroStrategy", {"train__parallel": {"data": "zero", "zero_stage": 2}}),
}
PREVIOUS_KEYS = {"format", "strategy", "world_size", "model", "consumed_samples", "step", "files", "bytes"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return cached_runs(tmp_path_factory, "old", BASE)


def _previous_release(first, tmp_path, strategy: str):
    """A copy of `first`'s checkpoint AT with meta.json as the previous release wrote it (DDP's in format
    "full": DDP writes DCP since, and reads its "full" checkpoints by the reader it always had)."""
    source = ckpt.step_dir(first / "checkpoints", AT)
    if strategy == "DDPStrategy":
        source = full_checkpoint(source, tmp_path / "full")
    old = tmp_path / "checkpoints" / source.name
    old.parent.mkdir()
    shutil.copytree(source, old)
    meta = ckpt.read_meta(old)
    meta = {k: v for k, v in meta.items() if k in PREVIOUS_KEYS} | {"strategy": strategy}
    (old / ckpt.META).write_text(json.dumps(meta, indent=2) + "\n")
    assert ckpt.verify(old) is None
    return old


def _resume(runs, tmp_path, old, nproc: int, sections: dict) -> tuple[object, str]:
    second = tmp_path / "second"
    cfg = make_cfg(second, **{**BASE, **sections, "train__checkpoint": {**BASE["train__checkpoint"],
                                                                         "resume": str(old)}})
    code, text = torchrun(cfg, runs.data, second, nproc=nproc)
    assert code == 0, text[-3000:]
    return second, text


@pytest.mark.parametrize("name", list(CASES))
def test_a_checkpoint_of_the_previous_release_resumes_by_its_own_reader_bitwise(runs, tmp_path, name):
    nproc, strategy, sections = CASES[name]
    first = runs(name, nproc=nproc, **sections)
    second, text = _resume(runs, tmp_path, _previous_release(first, tmp_path, strategy), nproc, sections)
    assert "resharded" not in text, text[-3000:]  # its own reader, not the portable one
    assert json.loads((second / "summary.json").read_text())["resumed_from"] == AT
    assert losses(second) == losses(first)[AT:]


def test_an_fsdp_checkpoint_of_the_previous_release_is_resharded_into_tensor_parallel(runs, tmp_path):
    """Its meta.json says only "dcp" and FSDPStrategy: the optimizer state is keyed as FSDP2 keys it,
    not as dp x tp x pp does, so it goes through the portable reader."""
    nproc, strategy, sections = CASES["dcp-fsdp"]
    first = runs("dcp-fsdp", nproc=nproc, **sections)
    second, text = _resume(runs, tmp_path, _previous_release(first, tmp_path, strategy), 2, CASES["dcp-mesh"][2])
    assert "resharded" in text, text[-3000:]
    assert json.loads((second / "summary.json").read_text())["resumed_from"] == AT
    torch.testing.assert_close(losses(second), losses(first)[AT:], rtol=0, atol=1e-5)
