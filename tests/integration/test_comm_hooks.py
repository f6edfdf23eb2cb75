"""DDP communication hooks on 2 gloo ranks: the bytes each rank all-reduces per step, losses beside
uncompressed DDP's, and PowerSGD's state carried through a checkpoint so a resumed run ends bitwise
where an uninterrupted one does."""

from __future__ import annotations

import os

import pytest
import torch

from llmpipe.checkpoint import io as ckpt
from llmpipe.train import metrics
from tests.conftest import cached_runs, checkpoint_weights, make_cfg, make_data_dir
from tests.conftest import torchrun as _torchrun

pytestmark = pytest.mark.slow

HOOKS = {"none": {}, "fp16": {"comm_hook": "fp16"}, "bf16": {"comm_hook": "bf16"},
         "powersgd": {"comm_hook": "powersgd", "powersgd_rank": 2, "start_powersgd_iter": 2}}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return cached_runs(tmp_path_factory, "hooks", {"train__max_steps": 6})


def _steps(out):
    return [r for r in metrics.read(out / "metrics.jsonl") if "loss" in r]


def test_hooks_count_what_they_send_and_train_like_uncompressed_ddp(run):
    recs = {name: _steps(run(name, train__parallel=par)) for name, par in HOOKS.items()}
    grads = recs["none"][0]["comm_bytes"]
    assert grads > 0 and all(r["comm_bytes"] == grads for r in recs["none"])  # every fp32 gradient, each step
    for half in ("fp16", "bf16"):
        assert [r["comm_bytes"] for r in recs[half]] == [grads // 2] * 6
    sent = [r["comm_bytes"] for r in recs["powersgd"]]
    assert sent[:2] == [grads] * 2  # plain all-reduce before start_powersgd_iter
    assert all(0 < s < grads / 5 for s in sent[2:]), sent  # rank-2 factors of the debug model's matrices
    base = [r["loss"] for r in recs["none"]]
    # NOTE: tolerances for 6 steps of the debug model: compression error moves losses in the 4th digit
    for name, rel in (("fp16", 1e-3), ("bf16", 5e-3), ("powersgd", 2e-2)):
        torch.testing.assert_close([r["loss"] for r in recs[name]], base, rtol=rel, atol=0)


def test_powersgd_state_is_in_every_ranks_checkpoint_and_a_resume_is_bitwise(tmp_path, monkeypatch):
    data = make_data_dir(tmp_path / "data")
    cfg = make_cfg(tmp_path, train__max_steps=8, train__checkpoint={"every_steps": 4, "keep_last": 5},
                   train__eval={"every_steps": 100, "batches": 1}, train__parallel=HOOKS["powersgd"])
    code, text = _torchrun(cfg, data, tmp_path / "whole")
    assert code == 0, text[-3000:]
    step4 = ckpt.step_dir(tmp_path / "whole" / "checkpoints", 4)
    assert ckpt.verify(step4) is None
    assert {p.name for p in step4.glob("comm_hook_rank*.pt")} == {"comm_hook_rank0.pt", "comm_hook_rank1.pt"}
    state = [torch.load(step4 / f"comm_hook_rank{r}.pt", weights_only=True) for r in (0, 1)]
    assert state[0]["iter"] >= 2 and state[0]["error"]  # PowerSGD was on, with error feedback
    # the error feedback is each rank's own (what compression left out of its own gradient)
    name = next(iter(state[0]["error"]))
    assert not torch.equal(state[0]["error"][name], state[1]["error"][name])

    monkeypatch.setenv("LLMPIPE_RAISE", "6:1")  # rank 1 fails in step 6, after the step-4 checkpoint
    code, _ = _torchrun(cfg, data, tmp_path / "cut")
    assert code != 0
    monkeypatch.delenv("LLMPIPE_RAISE")
    code, text = _torchrun(cfg, data, tmp_path / "cut")  # resumes from step 4
    assert code == 0, text[-3000:]
    resumed = [r for r in _steps(tmp_path / "cut") if r["step"] > 4]
    assert [r["loss"] for r in resumed][-4:] == [r["loss"] for r in _steps(tmp_path / "whole")][4:]
    a = checkpoint_weights(ckpt.step_dir(tmp_path / "whole" / "checkpoints", 8))
    b = checkpoint_weights(ckpt.step_dir(tmp_path / "cut" / "checkpoints", 8))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_one_process_ignores_the_hook(tmp_path):
    """nproc 1 has nothing to communicate: the hook is not used (logged) and nothing is counted."""
    data = make_data_dir(tmp_path / "data")
    cfg = make_cfg(tmp_path, train__max_steps=2, train__parallel={"comm_hook": "fp16"})
    code, text = _torchrun(cfg, data, tmp_path / "one", nproc=1)
    assert code == 0, text[-3000:]
    assert "one process communicates nothing" in text
    assert all("comm_bytes" not in r for r in _steps(tmp_path / "one"))
    assert os.path.isdir(tmp_path / "one" / "checkpoints")
