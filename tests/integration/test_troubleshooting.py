"""The troubleshooting switches (train.debug), each triggered on purpose on 2 gloo ranks: a NaN
injected into a gradient (guard stops naming it, or skips the update), a rank's parameters or
gradients made to differ (the replica checks name them), and the fp16 loss-scale watch. The faults
come from llmpipe.debug's test-only environment hooks."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from llmpipe.checkpoint import io as ckpt
from llmpipe.train import metrics
from tests.conftest import checkpoint_weights, make_cfg, make_data_dir
from tests.conftest import torchrun as _torchrun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data_dir(tmp_path_factory.mktemp("debug") / "data")


def _run(tmp_path: Path, data: Path, env: dict[str, str], **sections) -> tuple[int, str]:
    cfg = make_cfg(tmp_path, train__max_steps=3, train__checkpoint={"every_steps": 1}, **sections)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return _torchrun(cfg, data, tmp_path / "out")
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_nan_guard_stops_naming_the_parameter(tmp_path, data):
    code, text = _run(tmp_path, data, {"LLMPIPE_INJECT_NAN": "2"})
    assert code != 0
    assert "step 2: non-finite gradients on rank 0 in tok_embeddings.weight" in text, text[-2000:]
    assert "train.debug.nan_guard=stop" in text


def test_nan_guard_skip_drops_the_update_and_goes_on(tmp_path, data):
    code, text = _run(tmp_path, data, {"LLMPIPE_INJECT_NAN": "2"}, train__debug={"nan_guard": "skip"})
    assert code == 0, text[-2000:]
    records = [r for r in metrics.read(tmp_path / "out" / "metrics.jsonl") if "loss" in r]
    assert [r.get("skipped", False) for r in records] == [False, True, False]
    root = tmp_path / "out" / "checkpoints"
    w1, w2, w3 = (checkpoint_weights(ckpt.step_dir(root, s)) for s in (1, 2, 3))
    assert all(torch.equal(w1[k], w2[k]) for k in w1)  # step 2 changed nothing
    assert not all(torch.equal(w2[k], w3[k]) for k in w2)  # step 3 trained again
    assert all(torch.isfinite(v).all() for v in w3.values())


def test_initial_parameter_check_names_the_rank_that_differs(tmp_path, data):
    code, text = _run(tmp_path, data, {"LLMPIPE_PERTURB_PARAMS_RANK": "1"},
                      train__debug={"check_init_params": True})
    assert code != 0
    assert ("step 0: initial parameters differ across data-parallel replicas in 1 of" in text
            and "tok_embeddings.weight (ranks [1] differ from rank 0)" in text), text[-2000:]


def test_gradient_consistency_check_catches_a_diverging_rank(tmp_path, data):
    code, text = _run(tmp_path, data, {"LLMPIPE_PERTURB_GRADS": "2:1"},
                      train__debug={"check_grad_consistency_every": 1})
    assert code != 0
    assert "step 2: synchronised gradients differ across data-parallel replicas" in text, text[-2000:]


def test_checks_pass_on_a_healthy_run(tmp_path, data):
    code, text = _run(tmp_path, data, {}, train__debug={"check_init_params": True,
                                                         "check_grad_consistency_every": 1})
    assert code == 0, text[-2000:]
    assert "replicated parameter tensors equal on every data-parallel rank" in text


def test_loss_scale_watch_stops_a_collapsing_fp16_scale(tmp_path, data):
    # an initial scale of 1e38 overflows fp32 at once: the scaler skips and halves it
    code, text = _run(tmp_path, data, {}, train__precision={"dtype": "fp16", "loss_scale": {"init": 1e38}},
                      train__debug={"loss_scale_stop_below": 1e38})
    assert code != 0
    assert "step 1: fp16 loss scale 5e+37 fell below train.debug.loss_scale_stop_below=1e+38" in text, text[-2000:]


def test_a_silent_rank_runs_into_the_communication_timeout(tmp_path, data):
    import time

    t0 = time.monotonic()
    code, text = _run(tmp_path, data, {"LLMPIPE_HANG": "2:1"}, train__dist_timeout_s=10)
    elapsed = time.monotonic() - t0
    assert code != 0
    assert "LLMPIPE_HANG: rank 1 stops answering at step 2" in text
    assert re.search(r"[Tt]imed out|[Tt]imeout", text), text[-2000:]  # rank 0's collective gave up
    assert elapsed < 120  # not the hour rank 1 sleeps: torchrun tears the job down after the timeout
