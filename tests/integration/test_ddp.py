"""DDP on 2 gloo ranks under torchrun against single-process training on the same global batch."""

from __future__ import annotations

import os

import pytest
import torch

from llmpipe.checkpoint import io as ckpt
from llmpipe.train.loop import train
from tests.conftest import checkpoint_weights, make_cfg
from tests.conftest import losses as _losses
from tests.conftest import torchrun as _torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("static_graph", [True, False])
def test_ddp_two_ranks_match_single_process(tmp_path, data_dir, static_graph):
    # 2 ranks x micro 4 x accum 2 = global 16 = 1 rank x micro 8 x accum 2
    ddp = make_cfg(tmp_path, train__micro_batch_size=4, train__grad_accum_steps=2,
                   train__parallel={"static_graph": static_graph})
    single = make_cfg(tmp_path, train__micro_batch_size=8, train__grad_accum_steps=2)
    code, text = _torchrun(ddp, data_dir, tmp_path / "ddp")
    assert code == 0, text[-3000:]
    train(single, data_dir, tmp_path / "single")
    # NOTE: gloo's all-reduce sums in a different order than one process does: ~1e-7 relative.
    torch.testing.assert_close(_losses(tmp_path / "ddp"), _losses(tmp_path / "single"), rtol=1e-5, atol=1e-5)
    a = checkpoint_weights(ckpt.step_dir(tmp_path / "ddp" / "checkpoints", 6))
    b = checkpoint_weights(ckpt.step_dir(tmp_path / "single" / "checkpoints", 6))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_no_rank_aborts_at_exit(tmp_path, data_dir):
    """torch 2.13 + gloo can abort at interpreter exit; the teardown in train.main prevents it.
    LLMPIPE_EXIT_REPEATS=20 runs the full check from the issue (default 3 keeps CI short)."""
    repeats = int(os.environ.get("LLMPIPE_EXIT_REPEATS", "3"))
    cfg = make_cfg(tmp_path, train__max_steps=2, train__checkpoint={"every_steps": 2},
                   train__eval={"every_steps": 2, "batches": 1})
    for i in range(repeats):
        code, text = _torchrun(cfg, data_dir, tmp_path / f"run{i}")
        assert code == 0, f"run {i}: exit {code}\n{text[-3000:]}"
        assert "terminate called" not in text and "exitcode  : -6" not in text, text[-3000:]
