"""The quantised onnxruntime variants: weight-only int4 / int8w (MatMulNBits) and static int8s
(calibrated on validation text), their settings, their gates in the benchmark stage."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from llmpipe import device
from llmpipe.bench import run as bench
from llmpipe.config import ConfigError, QualitySection, QuantizeSection, from_dict
from llmpipe.infer.ort import create_session, make_variants
from llmpipe.stages import StageError
from tests.unit.test_bench import QUALITY, _ctx, _inputs

QUANTISED = ["int4", "int8w", "int8s"]
CALIBRATION = {"calibration_samples": 8, "calibration_decode_steps": 4}


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """The benchmark stage once with fp32 and the three quantised variants (the debug model)."""
    root = tmp_path_factory.mktemp("quant")
    inputs = _inputs(root)
    ctx = _ctx(root, inputs, variants=["fp32", *QUANTISED], quantize=CALIBRATION, torch_baseline=False,
               shapes=[[1, 16]])
    bench.run(ctx)
    return ctx, json.loads((ctx.work_dir / "results.json").read_text()), inputs


def _logits(path: Path, ids: np.ndarray) -> np.ndarray:
    return create_session(path, device.ort_providers(["cpu"])[0], 2).run(["logits"], {"input_ids": ids})[0]


def _ops(path: Path) -> dict[str, int]:
    ops: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


# Measured on the debug model (random weights, 2 x 16 tokens): max abs logit diff against fp32 int4 0.39,
# int8w 0.037, int8s 0.076; the tolerances leave ~2.5x room.
TOLERANCE = {"int4": 1.0, "int8w": 0.1, "int8s": 0.2}


def test_each_quantised_variant_stays_within_its_measured_tolerance_of_fp32(stage):
    ctx, results, inputs = stage
    exported = inputs["export_onnx"][0]
    ids = np.random.default_rng(3).integers(1, 300, (2, 16))
    ref = _logits(exported / "model.onnx", ids)
    for name in QUANTISED:
        for graph in ("model.onnx", "decoder_static.onnx"):
            assert (ctx.work_dir / "variants" / name / graph).is_file(), (name, graph)
        diff = float(np.abs(_logits(ctx.work_dir / "variants" / name / "model.onnx", ids) - ref).max())
        assert 0 < diff < TOLERANCE[name], (name, diff)


def test_weight_only_variants_are_matmulnbits_and_int8s_quantises_only_the_weight_matmuls(stage):
    ctx, _, inputs = stage
    fp32 = _ops(inputs["export_onnx"][0] / "model.onnx")
    for name in ("int4", "int8w"):
        ops = _ops(ctx.work_dir / "variants" / name / "model.onnx")
        # the 7 projections of each of the 2 layers and the output head; the attention products stay MatMul
        assert ops["MatMulNBits"] == 2 * 7 + 1 and ops["MatMul"] == fp32["MatMul"] - 15, (name, ops)
    static = _ops(ctx.work_dir / "variants" / "int8s" / "model.onnx")
    # QOperator: wq, wk, wv, wo, w1, w3 of each layer as QLinearMatMul; the down projections (w2), the
    # head and the attention products stay fp32 MatMul
    assert static["QLinearMatMul"] == 2 * 6 and static["MatMul"] == fp32["MatMul"] - 12, static


def test_the_quantised_variants_are_gated_and_generate_like_the_others(stage):
    _, results, _ = stage
    q = results["quality"]
    assert set(q["variants"]) == {"fp32", *QUANTISED}
    defaults = QualitySection()
    for name in QUANTISED:
        v, gate = q["variants"][name], getattr(defaults, name)
        # the debug model's random weights give near-ties, so a default gate may reject one: the verdict
        # must be the gate's, whichever it is
        broke = v["ppl_increase"] > gate.max_ppl_increase or v["top1"] < gate.min_top1
        assert v["verdict"] == ("rejected" if broke else "accepted"), (name, v)
        assert (name in q["rejected"]) == broke and 0 <= v["kl"] < 0.05, (name, v)
        assert 0 <= v["continuation"]["token_agreement"] <= 1
    decoded = {r["variant"] for r in results["llm"]["decode"] if not r.get("error")}
    assert set(QUANTISED) <= decoded
    names = [r["name"] for r in q["chain"]]
    assert names[2:] == ["ONNX fp32", "ONNX int4", "ONNX int8w", "ONNX int8s", "OM"]
    # each is made from the fp32 graph: its step in the chain is from ONNX fp32, not from the row above
    assert [r["prev"] for r in q["chain"][3:6]] == ["ONNX fp32"] * 3
    for row in q["chain"][3:6]:
        assert row["prev_kl"] == pytest.approx(row["kl"], rel=1e-3, abs=1e-9)  # fp32 is torch's logits within 1e-5


def test_a_branch_of_the_chain_steps_from_its_source_and_the_main_line_continues():
    from llmpipe.bench.quality import chain_rows

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 8, (2, 5))
    a, b, c = (rng.normal(size=(2, 5, 8)) for _ in range(3))
    rows = chain_rows(ids, [("ref", a, None), ("main", b, None), ("side", c, None), ("next", c, None)],
                      {"side": "ref"})
    assert [r["prev"] for r in rows] == [None, "ref", "ref", "main"]
    assert rows[2]["prev_kl"] == pytest.approx(rows[2]["kl"]) and rows[3]["prev_kl"] > 0


def test_a_quantised_variant_beyond_its_gate_fails_the_stage_in_one_line(stage):
    ctx, results, inputs = stage
    top1 = results["quality"]["variants"]["int4"]["top1"]
    ctx2 = _ctx(ctx.work_dir.parent, inputs, variants=["fp32", "int4"], torch_baseline=False, shapes=[[1, 16]],
                quality={**QUALITY, "enforce": True, "int4": {"min_top1": 1.0}}, require=["int4"])
    with pytest.raises(StageError) as err:
        bench.run(ctx2)
    assert str(err.value).startswith("benchmark: required variant int4 (benchmark.require) failed; 1 of 2 failed "
                                     f"their quality gates: int4: top-1 agreement {top1:.4f} < "
                                     "benchmark.quality.int4.min_top1=1 ")
    assert "\n" not in str(err.value)


def test_a_calibration_sample_larger_than_the_validation_shard_is_refused_before_any_variant(stage):
    ctx, _, inputs = stage
    ctx2 = _ctx(ctx.work_dir.parent, inputs, variants=["fp32", "int8s"], torch_baseline=False,
                quantize={"calibration_samples": 10_000})
    val = inputs["prepare_data"][0] / "val.bin"
    with pytest.raises(StageError) as err:
        bench.run(ctx2)
    assert str(err.value) == (f"benchmark.quantize.calibration_samples=10000 exceeds the 10 windows of 16 tokens "
                              f"the validation shard {val} holds; lower it (or calibration_seq_len)")
    assert not (ctx2.work_dir / "variants").exists()


@pytest.mark.parametrize(("key", "value", "message"), [
    ("int4.block_size", 24, "benchmark.quantize.int4.block_size: 24 is not a block size MatMulNBits takes "
                            "(a power of two, 16 or more) (got 24)"),
    ("int8w.block_size", 8, "benchmark.quantize.int8w.block_size: 8 is not a block size MatMulNBits takes "
                            "(a power of two, 16 or more) (got 8)"),
    ("int4.bits", 3, "benchmark.quantize.int4.bits: 3 bits is not a width onnxruntime's MatMulNBits packs "
                     "(2, 4 or 8) (got 3)"),
    ("int8w.accuracy_level", 5, "benchmark.quantize.int8w.accuracy_level: Input should be less than or equal to 4 "
                                "(got 5)"),
    ("static_format", "qint", "benchmark.quantize.static_format: Input should be 'qdq' or 'qoperator' (got 'qint')"),
])
def test_a_quantisation_setting_onnxruntime_cannot_apply_is_one_line_naming_the_field(key, value, message):
    section, _, field = key.rpartition(".")
    quantize = {section: {field: value}} if section else {field: value}
    with pytest.raises(ConfigError) as err:
        from_dict({"data": {"inputs": ["x"]}, "benchmark": {"quantize": quantize}}, check="fields")
    assert str(err.value) == f"config: {message}"


def test_the_defaults_are_the_measured_ones():
    q = QuantizeSection()
    assert (q.int4.bits, q.int4.block_size, q.int4.accuracy_level) == (4, 32, 4)
    assert (q.int8w.bits, q.int8w.block_size, q.int8w.accuracy_level) == (8, 32, 4)
    # setting one field keeps the variant's other defaults
    q = QuantizeSection.model_validate({"int8w": {"block_size": 128}})
    assert (q.int8w.bits, q.int8w.block_size) == (8, 128)


def test_int8s_without_calibration_data_is_a_recorded_failure_not_a_crash(stage, tmp_path):
    _, _, inputs = stage
    made = make_variants(inputs["export_onnx"][0] / "model.onnx", ["int8s"], tmp_path, quantize=QuantizeSection())
    assert made["int8s"].path is None
    assert made["int8s"].error == "ValueError: int8s needs calibration data (validation text), none was given"


def test_quantised_variants_of_a_model_with_external_data(tmp_path, monkeypatch):
    # The path a >1.8 GB model takes, forced on the debug model by a zero threshold.
    from llmpipe.bench import calibrate
    from llmpipe.export.onnx import export_prefill
    from llmpipe.infer import ort as bench_ort
    from llmpipe.infer.graphs import model_files
    from llmpipe.models.llama import FLAVORS, Transformer

    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    export_prefill(model, tmp_path / "model.onnx", opset=17, external_data_bytes=0)
    monkeypatch.setattr(bench_ort, "EXTERNAL_DATA_BYTES", 0)
    ids = np.random.default_rng(0).integers(1, model.args.vocab_size, (4, 8))
    made = bench_ort.make_variants(tmp_path / "model.onnx", QUANTISED, tmp_path / "variants",
                                   quantize=QuantizeSection(), calibration=lambda: calibrate.prefill_reader(ids))
    ref = _logits(tmp_path / "model.onnx", ids)
    for name in QUANTISED:
        assert made[name].error is None, made[name].error
        files = model_files(made[name].path)
        assert len(files) > 1 and all(f.parent == made[name].path.parent for f in files), files
        assert float(np.abs(_logits(made[name].path, ids) - ref).max()) < TOLERANCE[name]
