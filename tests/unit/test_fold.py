"""llmpipe.infer.fold: HQQ's float zero points folded into integer ones plus appended block-sum rows, checked
against the float-zero-point graph onnxruntime's own quantizer wrote (same inputs, same session settings)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmpipe.infer import fold
from llmpipe.infer.ort import _nbits


def _matmul_model(k: int, n: int, rank: int, seed: int = 0) -> tuple[onnx.ModelProto, np.ndarray]:
    w = (np.random.default_rng(seed).standard_normal((k, n)) * 0.05).astype(np.float32)
    dims = ["b", "s"][: rank - 1]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [*dims, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [*dims, n])
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")]
    graph = helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(w, "W")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]


def _zero_point_types(model: onnx.ModelProto) -> list[int]:
    inits = {t.name: t for t in model.graph.initializer}
    return [inits[n.input[3]].data_type for n in model.graph.node if n.op_type == "MatMulNBits"]


@pytest.mark.parametrize("k,n,rank", [(576, 96, 3), (1536, 64, 3), (256, 48, 2)])
def test_the_folded_node_computes_what_the_float_zero_points_did(k, n, rank):
    model, w = _matmul_model(k, n, rank)
    hqq = _nbits(model, 4, 32, 0, False, "hqq")
    assert _zero_point_types(hqq) == [TensorProto.FLOAT]
    folded = onnx.ModelProto()
    folded.CopyFrom(hqq)
    assert fold.fold_model(folded) == 1
    assert _zero_point_types(folded) == [TensorProto.UINT8]
    ops = [node.op_type for node in folded.graph.node]
    assert ops == ["Reshape", "ReduceSum", "Concat", "MatMulNBits"]
    x = np.random.default_rng(1).standard_normal((2, 5, k)[3 - rank:]).astype(np.float32)
    ref, y_hqq, y_fold = x @ w, _run(hqq, x), _run(folded, x)
    scale = np.abs(ref).mean()
    quant_error = np.abs(y_hqq - ref).mean() / scale  # HQQ's own 4-bit error, about 7% on these weights
    fold_error = np.abs(y_fold - y_hqq).mean() / scale
    # the fold adds the rounding of the per-block corrections: under a tenth of the 4-bit error itself
    assert 0.02 < quant_error < 0.15 and fold_error < quant_error / 10, (quant_error, fold_error)


def test_the_folded_weights_dequantise_to_the_float_grid_within_a_thirtieth_of_its_step():
    rng = np.random.default_rng(2)
    k, n, block = 128, 8, 32
    nb = k // block
    q = rng.integers(0, 16, (n, nb, block)).astype(np.uint8)
    scales = rng.uniform(0.01, 0.02, (n, nb)).astype(np.float32)
    zf = rng.uniform(0, 15, (n, nb)).astype(np.float32)
    packed = fold.pack4(q)
    want = fold.dequantize(packed, scales, zf, k, n, block, float_zp=True)
    b, s, z, ne = fold.fold_weights(packed, scales, zf, k, n, block)
    assert ne == 1 and b.shape == (n, nb + ne, block // 2) and s.shape == (n * (nb + ne),)
    integer_part = fold.dequantize(b, s, z, k + nb, n, block, float_zp=False)  # [K + nb, N]
    # the first K rows are the integer-zero-point weights, the next nb rows the per-block corrections
    got = integer_part[:k] + np.repeat(integer_part[k:k + nb], block, axis=0)
    assert np.abs(got - want).max() <= scales.max() / 30 + 1e-7


def test_nodes_it_cannot_fold_are_left_as_they_were():
    model, _ = _matmul_model(80, 16, 3)  # K = 80 is not whole blocks of 32
    hqq = _nbits(model, 4, 32, 0, False, "hqq")
    before = hqq.SerializeToString()
    assert fold.fold_model(hqq) == 0 and hqq.SerializeToString() == before
    rtn = _nbits(_matmul_model(64, 16, 3)[0], 4, 32, 0, False, "rtn")  # integer zero points already
    assert fold.fold_model(rtn) == 0
