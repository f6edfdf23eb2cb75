"""benchmark quality: the validation sample, perplexity and agreement on known logits, gates, the
parity chain, the training checkpoint as a model."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from llmpipe.bench.quality import (
    Verdict,
    chain_markdown,
    chain_rows,
    checkpoint_logits_model,
    continuation_agreement,
    enforce_gates,
    judge,
    perplexity,
    text_metrics,
    val_sample,
)
from llmpipe.checkpoint import io as ckpt
from llmpipe.config import QualitySection
from llmpipe.data.shards import write_shard
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.optim import param_order
from llmpipe.stages import StageError

# ---- the validation sample ------------------------------------------------------------------


@pytest.fixture
def val_bin(tmp_path) -> Path:
    """101 tokens 0..100 in three documents: windows of 10 tokens start every 9 tokens, 11 of them."""
    return write_shard(tmp_path / "val.bin", [np.arange(0, 40), np.arange(40, 90), np.arange(90, 101)], "uint16")


def test_the_sample_is_seeded_distinct_windows_of_seq_len_tokens(val_bin):
    ids = val_sample(val_bin, 4, seq_len=10, seed=0)
    assert ids.shape == (4, 10) and ids.dtype == np.int64
    starts = ids[:, 0]
    assert np.all(starts % 9 == 0) and len(set(starts.tolist())) == 4 and np.all(np.diff(starts) > 0)
    np.testing.assert_array_equal(ids, starts[:, None] + np.arange(10))  # contiguous stream windows
    np.testing.assert_array_equal(val_sample(val_bin, 4, seq_len=10, seed=0), ids)
    others = [val_sample(val_bin, 4, seq_len=10, seed=s)[:, 0].tolist() for s in range(1, 6)]
    assert any(o != starts.tolist() for o in others)


def test_asking_for_more_sequences_than_the_shard_holds_gives_every_window_once(val_bin):
    ids = val_sample(val_bin, 50, seq_len=10, seed=3)
    assert ids.shape == (11, 10)
    np.testing.assert_array_equal(ids[:, 0], 9 * np.arange(11))
    assert val_sample(val_bin, 1, seq_len=101, seed=0).tolist() == [list(range(101))]  # exactly one sequence


def test_a_shard_shorter_than_one_sequence_is_a_one_line_error(val_bin):
    with pytest.raises(StageError) as err:
        val_sample(val_bin, 16, seq_len=102, seed=0)
    assert str(err.value) == (f"benchmark.quality: the validation shard {val_bin} holds 101 tokens, fewer than "
                              "one sequence of 102; lower benchmark.quality.seq_len")


# ---- perplexity and agreement on known logits -----------------------------------------------


def test_uniform_logits_have_the_vocabulary_size_as_perplexity():
    ids = np.random.default_rng(0).integers(0, 7, size=(3, 5))
    assert perplexity(ids, np.zeros((3, 5, 7), np.float32)) == pytest.approx(7.0, rel=1e-12)
    assert perplexity(ids, np.full((3, 5, 7), 1e4, np.float16)) == pytest.approx(7.0, rel=1e-12)  # no overflow


def test_identical_logits_have_no_kl_full_top1_and_no_perplexity_increase():
    rng = np.random.default_rng(1)
    ids, logits = rng.integers(0, 11, size=(2, 6)), rng.normal(size=(2, 6, 11)).astype(np.float32)
    m = text_metrics(ids, logits, logits.copy())
    assert m["ppl"] == m["ppl_ref"] == pytest.approx(perplexity(ids, logits))
    assert m["ppl_increase"] == 0.0 and m["top1"] == 1.0 and m["max_abs_diff"] == 0.0
    assert m["kl"] == pytest.approx(0.0, abs=1e-12)
    assert all(type(v) is float for v in m.values())


def test_a_hand_computed_two_token_three_word_case():
    ids = np.array([[0, 2]])
    ref = np.array([[[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]])  # position 0 uniform: p(2) = 1/3
    cand = np.array([[[0.0, 0.0, math.log(2)], [1.0, 0.0, 0.0]]])  # position 0 (1/4, 1/4, 1/2): p(2) = 1/2
    m = text_metrics(ids, ref, cand)
    assert m["ppl_ref"] == pytest.approx(3.0) and m["ppl"] == pytest.approx(2.0)
    assert m["ppl_increase"] == pytest.approx(-1 / 3)
    # KL at position 0: 1/3 * (ln(4/3) + ln(4/3) + ln(2/3)) = ln(32/27) / 3; position 1: 0; mean of the two
    assert m["kl"] == pytest.approx(math.log(32 / 27) / 6)
    assert m["top1"] == 0.5 and m["max_abs_diff"] == pytest.approx(math.log(2))


def test_half_precision_logits_score_as_their_float64_values():
    rng = np.random.default_rng(2)
    ids, ref = rng.integers(0, 13, size=(2, 4)), rng.normal(size=(2, 4, 13))
    half = ref.astype(np.float16)
    assert text_metrics(ids, ref, half) == pytest.approx(text_metrics(ids, ref, half.astype(np.float64)))
    with pytest.raises(ValueError, match="logit shapes differ"):
        text_metrics(ids, ref, ref[..., :12])


def test_continuations_agree_token_by_token_by_prefix_and_by_row():
    ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8]])
    out = np.array([[1, 2, 9, 4], [1, 2, 3, 4], [0, 6, 7, 8]])
    assert continuation_agreement(ref, out) == pytest.approx(
        {"token_agreement": 10 / 12, "prefix_match": (2 + 4 + 0) / 3 / 4, "identical": 1 / 3})
    assert continuation_agreement(ref, ref) == {"token_agreement": 1.0, "prefix_match": 1.0, "identical": 1.0}


# ---- gates ----------------------------------------------------------------------------------


def _metrics(ppl_increase: float, top1: float) -> dict[str, float]:
    return {"ppl": 10 * (1 + ppl_increase), "ppl_ref": 10.0, "ppl_increase": ppl_increase, "kl": 0.01,
            "top1": top1, "max_abs_diff": 0.5}


def test_each_variant_is_judged_by_its_own_limits_and_torch_always_passes():
    metrics = {"torch": _metrics(5.0, 0.0), "fp32": _metrics(0.0, 1.0), "fp16": _metrics(0.005, 0.99),
               "int8": _metrics(0.0312, 0.84), "om": _metrics(0.03, 0.99)}
    verdicts = judge(metrics, QualitySection(), sequences=16)  # int8: 5% / 0.90, om: 2% / 0.95
    assert [(v.variant, v.passed) for v in verdicts] == [
        ("torch", True), ("fp32", True), ("fp16", True), ("int8", False), ("om", False)]
    assert verdicts[3] == Verdict("int8", False, "min_top1", 0.84, 0.90, 16)
    assert verdicts[4] == Verdict("om", False, "max_ppl_increase", 0.03, 0.02, 16)
    assert enforce_gates(verdicts, enforce=False) == ["int8", "om"]


def test_a_required_variant_that_fails_fails_the_stage_in_one_line_naming_every_failing_variant():
    quality = QualitySection(int8={"max_ppl_increase": 0})
    verdicts = judge({"fp16": _metrics(0.0, 0.5), "int8": _metrics(0.0312, 0.9), "fp32": _metrics(0.0, 1.0)},
                     quality, sequences=16)
    assert enforce_gates(verdicts, enforce=True) == ["fp16", "int8"]  # nothing required: recorded, fp32 deployable
    with pytest.raises(StageError) as err:
        enforce_gates(verdicts, enforce=True, required=["int8"])
    assert str(err.value) == (
        "benchmark: required variant int8 (benchmark.require) failed; 2 of 3 failed their quality gates: "
        "fp16: top-1 agreement 0.5000 < benchmark.quality.fp16.min_top1=0.98 on 16 validation sequences; "
        "int8: perplexity +3.12% > benchmark.quality.int8.max_ppl_increase=0 on 16 validation sequences "
        "(relax a limit under benchmark.quality, or set benchmark.quality.enforce: false)")
    assert enforce_gates(verdicts, enforce=False, required=["int8"]) == ["fp16", "int8"]
    assert enforce_gates(verdicts[2:], enforce=True, required=["fp32"]) == []


def test_the_stage_fails_when_no_variant_is_left_deployable():
    verdicts = judge({"fp32": _metrics(0.5, 1.0), "int8": _metrics(0.0, 0.5)}, QualitySection(), sequences=4)
    with pytest.raises(StageError, match=r"^benchmark: no variant is left deployable; 2 of 2 failed their quality "
                                         r"gates: fp32: perplexity \+50.00% > .*; int8: top-1 agreement 0.5000 < "):
        enforce_gates(verdicts, enforce=True)


def test_a_limit_set_to_null_is_no_limit_and_nan_fails_any_limit():
    quality = QualitySection(fp16={"max_ppl_increase": None, "min_top1": None})
    assert judge({"fp16": _metrics(math.nan, 0.0)}, quality) == [Verdict("fp16", True)]
    [nan] = judge({"fp16": _metrics(math.nan, 1.0)}, QualitySection())
    assert (nan.passed, nan.metric, nan.limit) == (False, "max_ppl_increase", 0.01)
    assert nan.message().startswith("benchmark: fp16 fails its quality gate: perplexity +nan% is not finite, "
                                    "limit benchmark.quality.fp16.max_ppl_increase=0.01 (rejected")


# ---- the parity chain -----------------------------------------------------------------------


def test_the_chain_compares_each_hop_with_the_reference_and_the_previous_hop_and_marks_the_largest_step():
    rng = np.random.default_rng(4)
    ids, ckpt_logits = rng.integers(0, 17, size=(2, 8)), rng.normal(size=(2, 8, 17)).astype(np.float32)
    fp32 = ckpt_logits + rng.normal(scale=1e-4, size=ckpt_logits.shape).astype(np.float32)
    fp16 = (fp32 + rng.normal(scale=0.3, size=fp32.shape)).astype(np.float16)
    rows = chain_rows(ids, [("training checkpoint", ckpt_logits, None), ("consolidated weights", ckpt_logits, None),
                            ("ONNX fp32", fp32, None), ("ONNX fp16", fp16, None),
                            ("ONNX int8", None, "benchmark.variants has no int8"),
                            ("OM", None, "convert_om was skipped (CANN toolkit not found)")])
    first, consolidated, onnx32, onnx16, int8, om = rows
    assert (first["ppl"], first["kl"], first["top1"], first["max_abs_diff"]) == (perplexity(ids, ckpt_logits),
                                                                                0.0, 1.0, 0.0)
    assert first["prev"] is None and first["prev_kl"] is None
    assert (consolidated["prev"], consolidated["prev_kl"], consolidated["prev_max_abs_diff"]) == (
        "training checkpoint", 0.0, 0.0)
    vs_ref, vs_prev = text_metrics(ids, ckpt_logits, fp16), text_metrics(ids, fp32, fp16)
    assert onnx16["kl"] == pytest.approx(vs_ref["kl"]) and onnx16["top1"] == vs_ref["top1"]
    assert onnx16["prev"] == "ONNX fp32" and onnx16["prev_kl"] == pytest.approx(vs_prev["kl"])
    assert onnx16["prev_max_abs_diff"] == pytest.approx(vs_prev["max_abs_diff"])
    assert 0 < onnx32["prev_kl"] < onnx16["prev_kl"]
    assert [r["moved"] for r in rows] == [False, False, False, True, False, False]
    assert (int8["ppl"], int8["reason"], om["moved"]) == (None, "benchmark.variants has no int8", False)
    json.dumps(rows)  # plain numbers and strings only

    md = chain_markdown(rows)
    assert sum(line.startswith("|") for line in md.splitlines()) == 8  # header, separator, six hops
    assert f"The largest step is ONNX fp16: KL {onnx16['prev_kl']:.3g} vs ONNX fp32" in md
    assert "| **ONNX fp16** |" in md
    assert "| OM | not measured: convert_om was skipped (CANN toolkit not found) |" in md


def test_a_chain_with_one_measured_hop_marks_no_step():
    ids, logits = np.zeros((1, 3), np.int64), np.zeros((1, 3, 4))
    rows = chain_rows(ids, [("training checkpoint", logits, None), ("OM", None, "no OM model")])
    assert [r["moved"] for r in rows] == [False, False] and rows[0]["ppl"] == pytest.approx(4.0)
    assert "Fewer than two hops were measured" in chain_markdown(rows)


# ---- the training checkpoint as a model -----------------------------------------------------

ARGS = replace(FLAVORS["debug"], vocab_size=256, max_seq_len=64)


def _save_full(root: Path, step: int, seed: int) -> Transformer:
    """A "full"-format checkpoint as DDP writes one: weights, optimizer state in param_order, trainer state."""
    model = Transformer(ARGS)
    model.init_weights(seed=seed)
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([params[n] for n in param_order(model)])

    def write(folder: Path) -> list[Path]:
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / ckpt.MODEL))
        torch.save(opt.state_dict(), folder / ckpt.OPTIM)
        torch.save({"step": step, "consumed_samples": 0, "scheduler": {}}, folder / ckpt.TRAINER)
        return [folder / ckpt.MODEL, folder / ckpt.OPTIM, folder / ckpt.TRAINER]

    ckpt.save(root / "checkpoints", step, write, {"format": "full", "model": ARGS.to_dict()})
    return model


def test_the_newest_verified_checkpoint_gives_the_trained_models_logits(tmp_path):
    (tmp_path / "model_config.json").write_text(json.dumps({"model": ARGS.to_dict()}))
    older = _save_full(tmp_path, 1, seed=1)
    newest = _save_full(tmp_path, 2, seed=2)
    x = torch.randint(0, ARGS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = checkpoint_logits_model(tmp_path)
        assert not got.training and next(got.parameters()).dtype == torch.float32
        torch.testing.assert_close(got(x), newest(x), rtol=0, atol=0)
        weights = ckpt.step_dir(tmp_path / "checkpoints", 2) / ckpt.MODEL
        data = weights.read_bytes()
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # corrupt the newest: the older one is used
        torch.testing.assert_close(checkpoint_logits_model(tmp_path)(x), older(x), rtol=0, atol=0)


def test_no_verified_checkpoint_is_a_one_line_error(tmp_path):
    with pytest.raises(StageError) as err:
        checkpoint_logits_model(tmp_path)
    assert str(err.value) == f"benchmark.quality: no verified training checkpoint in {tmp_path / 'checkpoints'}"
