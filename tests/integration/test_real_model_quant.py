"""The int4 recipe on the real model (SmolLM2-135M-Instruct, the shipped weights): the default (HQQ in blocks
of 32, zero points folded to integers, head at 8 bits) passes int4's default gate, and round to nearest
with integer zero points (what every fast 4-bit path did before) fails it. The graphs are those the
benchmark stage deploys on the CPU: onnxruntime-genai's builder graph of the HF folder, quantized by
llmpipe.infer.ort.quantize_weight_only. The full table: benchmarks/quant_recipes.py,
docs/measurements/quantisation.md (measured there on 8 windows of 128 tokens; here 4 of 96)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from llmpipe.bench import quality
from llmpipe.config import QualitySection, QuantizeSection
from llmpipe.export import fused
from llmpipe.infer.ort import quantize_weight_only

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import quant_recipes  # noqa: E402


@pytest.fixture(scope="module")
def smollm2_graphs(smollm2_hf, tmp_path_factory):
    if fused.unavailable_reason():
        pytest.fail(fused.unavailable_reason())
    root = tmp_path_factory.mktemp("smollm2_quant")
    fp32 = fused.build(smollm2_hf, root / "fp32", "fp32").parent
    ids = quant_recipes.text_windows(smollm2_hf / "tokenizer.json", 4, 96, 1234, calibration=False)
    ref = quant_recipes.OrtRunner(fp32, 2, 104).logits(ids)
    return root, fp32, ids, ref


def _metrics(folder: Path, ids: np.ndarray, ref: np.ndarray) -> dict:
    return quality.text_metrics(ids, ref, quant_recipes.OrtRunner(folder, 2, 104).logits(ids))


def _variant(root: Path, fp32: Path, name: str, section) -> Path:
    import shutil

    out = root / name
    shutil.copytree(fp32, out, ignore=shutil.ignore_patterns("model.onnx", "model.onnx.data"))
    quantize_weight_only(fp32 / "model.onnx", out / "model.onnx", section.bits, section.block_size,
                         section.accuracy_level, section.symmetric, section.algorithm, section.head_bits,
                         section.zero_points)
    return out


def test_the_default_int4_passes_its_gate_on_the_real_model_and_round_to_nearest_does_not(smollm2_graphs):
    root, fp32, ids, ref = smollm2_graphs
    gates = QualitySection()
    default = QuantizeSection().int4
    rtn = QuantizeSection.model_validate({"int4": {"algorithm": "rtn"}}).int4
    folder = _variant(root, fp32, "int4", default)
    nodes = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.node
    inits = {t.name: t for t in onnx.load(str(folder / "model.onnx"), load_external_data=False).graph.initializer}
    nbits = [n for n in nodes if n.op_type == "MatMulNBits"]
    # every MatMulNBits on onnxruntime's fast path: integer (uint8) zero points, none float
    assert nbits and all(inits[n.input[3]].data_type == onnx.TensorProto.UINT8 for n in nbits)
    m = _metrics(folder, ids, ref)
    verdict = quality.judge({"int4": m}, gates)[0]
    assert verdict.passed, verdict.message()
    assert m["ppl_increase"] < 0.03 and m["kl"] < 0.02, m  # measured +1.1% / KL 0.005 on 8 windows of 128
    m_rtn = _metrics(_variant(root, fp32, "int4_rtn", rtn), ids, ref)
    assert not quality.judge({"int4": m_rtn}, gates)[0].passed, m_rtn  # measured +29% / KL 0.31
