"""Training loop behaviour in one process: schedule, sampler, accumulation, resume, checkpoints."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from llmpipe.checkpoint import io as ckpt
from llmpipe.data.sampler import GlobalBatchSampler
from llmpipe.optim import build_optimizer, lr_factor
from llmpipe.train import metrics
from llmpipe.train.loop import train
from tests.conftest import checkpoint_weights, make_cfg
from tests.conftest import losses as _losses


def test_lr_schedule_warmup_then_cosine_to_min():
    f = [lr_factor(s, 10, 100, "cosine", 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(f[10:], f[11:]))
    assert f[-1] == pytest.approx(0.1, abs=1e-3)
    assert lr_factor(50, 0, 100, "constant", 0.1) == 1.0


def test_sampler_global_batch_is_independent_of_the_split():
    """The samples of a step are the same set whether split over ranks or micro-steps."""
    a = GlobalBatchSampler(97, micro_batch=4, grad_accum=2, world_size=2, seed=3)
    b = GlobalBatchSampler(97, micro_batch=8, grad_accum=2, world_size=1, seed=3)
    for consumed in (0, 16, 96):
        sa = np.concatenate([a.micro_batch_indices(consumed, m, r) for m in range(2) for r in range(2)])
        sb = np.concatenate([b.micro_batch_indices(consumed, m, 0) for m in range(2)])
        assert sorted(sa) == sorted(sb)
    # every sample is seen once per epoch
    assert sorted(a.positions(0, 97)) == list(range(97))


def test_loss_decreases(tmp_path, data_dir):
    cfg = make_cfg(tmp_path, train__max_steps=40, train__optim={"lr": 1e-2})
    summary = train(cfg, data_dir, tmp_path / "out")
    assert summary["val_loss"] < summary["val_loss_start"] - 1.5


@pytest.mark.parametrize("mb,accum", [(4, 2), (2, 4)])
def test_accumulation_equals_one_big_batch(tmp_path, data_dir, mb, accum):
    """k micro-batches of b accumulate to the same step as one batch of k*b (fp32)."""
    ref = make_cfg(tmp_path / "ref", train__micro_batch_size=8, train__grad_accum_steps=1)
    acc = make_cfg(tmp_path / "acc", train__micro_batch_size=mb, train__grad_accum_steps=accum)
    train(ref, data_dir, tmp_path / "ref_out")
    train(acc, data_dir, tmp_path / "acc_out")
    torch.testing.assert_close(_losses(tmp_path / "acc_out"), _losses(tmp_path / "ref_out"), rtol=1e-5, atol=1e-5)
    wa = checkpoint_weights(ckpt.step_dir(tmp_path / "ref_out" / "checkpoints", 6))
    wb = checkpoint_weights(ckpt.step_dir(tmp_path / "acc_out" / "checkpoints", 6))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


def test_resume_reproduces_the_uninterrupted_run_exactly(tmp_path, data_dir):
    cfg = make_cfg(tmp_path)
    full, part = tmp_path / "full", tmp_path / "part"
    train(cfg, data_dir, full)
    train(cfg, data_dir, part)
    # Simulate a crash after step 5: the step-6 checkpoint never landed.
    shutil.rmtree(ckpt.step_dir(part / "checkpoints", 6))
    summary = train(cfg, data_dir, part)
    assert summary["resumed_from"] == 3
    assert _losses(part) == _losses(full)  # bitwise: same floats
    wa = checkpoint_weights(ckpt.step_dir(full / "checkpoints", 6))
    wb = checkpoint_weights(ckpt.step_dir(part / "checkpoints", 6))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_corrupted_newest_checkpoint_falls_back_to_the_previous(tmp_path, data_dir, caplog):
    cfg = make_cfg(tmp_path)
    out = tmp_path / "out"
    train(cfg, data_dir, out)
    newest = min((ckpt.step_dir(out / "checkpoints", 6) / "dcp").glob("*.distcp"))
    data = bytearray(newest.read_bytes())
    data[-1] ^= 0xFF
    newest.write_bytes(bytes(data))
    assert ckpt.latest_valid(out / "checkpoints") == ckpt.step_dir(out / "checkpoints", 3)
    assert "step-000006 is not usable" in caplog.text


def test_keep_last_prunes_old_checkpoints(tmp_path, data_dir):
    cfg = make_cfg(tmp_path, train__checkpoint={"every_steps": 1, "keep_last": 2})
    train(cfg, data_dir, tmp_path / "out")
    assert [p.name for p in ckpt.list_steps(tmp_path / "out" / "checkpoints")] == ["step-000005", "step-000006"]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_mixed_precision_trains_close_to_fp32(tmp_path, data_dir, dtype):
    ref = make_cfg(tmp_path / "a")
    mp = make_cfg(tmp_path / "b", train__precision={"dtype": dtype})
    train(ref, data_dir, tmp_path / "ref")
    summary = train(mp, data_dir, tmp_path / "mp")
    # NOTE: bf16 has an 8-bit mantissa; per-step losses agree to ~1e-2 on this model.
    torch.testing.assert_close(_losses(tmp_path / "mp"), _losses(tmp_path / "ref"), rtol=3e-2, atol=3e-2)
    if dtype == "fp16":
        rec = [r for r in metrics.read(tmp_path / "mp" / "metrics.jsonl") if "loss" in r]
        assert all("loss_scale" in r for r in rec)
    assert np.isfinite(summary["final_loss"])


def test_activation_checkpointing_gives_identical_losses(tmp_path, data_dir):
    a = make_cfg(tmp_path / "a")
    b = make_cfg(tmp_path / "b", train__activation_checkpointing=True)
    train(a, data_dir, tmp_path / "a_out")
    train(b, data_dir, tmp_path / "b_out")
    torch.testing.assert_close(_losses(tmp_path / "b_out"), _losses(tmp_path / "a_out"), rtol=1e-6, atol=1e-6)
    keys = checkpoint_weights(ckpt.step_dir(tmp_path / "b_out" / "checkpoints", 6)).keys()
    assert not any("checkpoint_wrapped" in k for k in keys)


def test_linear_lr_scaling_against_a_reference_batch(tmp_path):
    from llmpipe.optim import peak_lr

    cfg = make_cfg(tmp_path, train__micro_batch_size=4, train__grad_accum_steps=8,
                   train__optim={"lr": 3e-4, "lr_reference_batch": 256})
    assert peak_lr(cfg, world=8) == pytest.approx(3e-4 * 256 / 256)  # 4 x 8 x dp 8 = 256
    assert peak_lr(cfg, world=2) == pytest.approx(3e-4 * 64 / 256)
    tp = make_cfg(tmp_path, "fields", train__micro_batch_size=4, train__grad_accum_steps=8,  # debug: 2 kv heads
                  train__optim={"lr": 3e-4, "lr_reference_batch": 256}, train__parallel={"tp": 4, "pp": 2})
    assert peak_lr(tp, world=64) == pytest.approx(3e-4)  # only dp = 64 / (4 x 2) multiplies the batch
    assert peak_lr(make_cfg(tmp_path, train__optim={"lr": 1e-3}), world=8) == 1e-3  # no reference: as given
    opt, _ = build_optimizer(torch.nn.Linear(2, 2), cfg)  # one process: 4 x 8 x 1 = 32 sequences
    assert opt.param_groups[0]["initial_lr"] == pytest.approx(3e-4 * 32 / 256)


def test_warmup_in_micro_batches_is_divided_by_accumulation(tmp_path):
    from llmpipe.optim import warmup_steps

    steps = make_cfg(tmp_path, train__grad_accum_steps=8, train__schedule={"warmup_steps": 2000})
    micro = make_cfg(tmp_path, train__grad_accum_steps=8,
                     train__schedule={"warmup_steps": 2000, "warmup_unit": "micro_batches"})
    assert warmup_steps(steps) == 2000 and warmup_steps(micro) == 250
    odd = make_cfg(tmp_path, train__grad_accum_steps=3,
                   train__schedule={"warmup_steps": 10, "warmup_unit": "micro_batches"})
    assert warmup_steps(odd) == 4  # rounded up


def test_wsd_holds_the_peak_until_its_decay_and_a_longer_horizon_only_moves_the_decay():
    f = [lr_factor(s, 2, 12, "wsd", 0.1, 0.25) for s in range(12)]
    assert f[:9] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # warm-up, then exactly the peak
    assert f[-1] == pytest.approx(0.1) and all(a > b for a, b in zip(f[8:], f[9:]))
    short = [lr_factor(s, 2, 8, "wsd", 0.1, 0.25) for s in range(8)]  # decays from step 6
    assert short[:6] == f[:6] and short[6] < 1.0


def test_every_checkpoint_folder_carries_the_resolved_config_and_the_tokenizer(tmp_path, data_dir):
    from llmpipe import config as config_mod

    (data_dir / "tokenizer.json").write_text('{"model": {"type": "BPE"}}\n')
    cfg = make_cfg(tmp_path, train__max_steps=2, train__checkpoint={"every_steps": 1, "keep_last": 5})
    train(cfg, data_dir, tmp_path / "out")
    for step in (1, 2):
        folder = ckpt.step_dir(tmp_path / "out" / "checkpoints", step)
        assert ckpt.verify(folder) is None  # listed and hashed with the state
        assert {"config.yaml", "tokenizer.json"} <= set(ckpt.read_meta(folder)["files"])
        assert (folder / "tokenizer.json").read_text() == '{"model": {"type": "BPE"}}\n'
        assert config_mod.load(folder / "config.yaml").to_dict() == cfg.to_dict()
