"""llmpipe.infer.native: llmpipe's own 4-bit kernel as the onnxruntime custom op llmpipe.Q4Gemv, compiled here
with the machine's cc. Checked against onnxruntime's MatMulNBits on the same HQQ weights (what the node it
replaces computed) and against the fp32 product of the dequantised weights, at 1 and 2 threads (2: the op's
tiles split by onnxruntime's thread pool), for one row (decode), several (a prompt, batch 8) and a 3-D input."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from pydantic import ValidationError

from llmpipe.config import QuantizeSection
from llmpipe.device import OrtProvider
from llmpipe.infer import fold, native
from llmpipe.infer.ort import _nbits, create_session
from tests.conftest import as_layout_1

needs_kernel = pytest.mark.skipif(native.unavailable() is not None, reason=str(native.unavailable()))


def _model(k: int, n_out: list[int], seed: int = 0) -> onnx.ModelProto:
    """x [b, s, k] through one MatMul per entry of n_out (the same input, as q / k / v read it)."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", k])
    nodes, inits, outs = [], [], []
    for i, n in enumerate(n_out):
        inits.append(numpy_helper.from_array((rng.standard_normal((k, n)) * 0.05).astype(np.float32), f"W{i}"))
        nodes.append(helper.make_node("MatMul", ["x", f"W{i}"], [f"y{i}"], name=f"mm{i}"))
        outs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, ["b", "s", n]))
    graph = helper.make_graph(nodes, "g", [x], outs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _hqq(model: onnx.ModelProto) -> onnx.ModelProto:
    return _nbits(model, 4, 32, 4, False, "hqq")


def _session(model: onnx.ModelProto, threads: int, lib: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    if lib:
        opts.register_custom_ops_library(str(native.library()))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _weights(model: onnx.ModelProto) -> list[np.ndarray]:
    """Each MatMulNBits node's [K, N] float weight (llmpipe.infer.fold.dequantize)."""
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    out = []
    for node in model.graph.node:
        at = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        zp = inits[node.input[3]]
        out.append(fold.dequantize(inits[node.input[1]], inits[node.input[2]], zp, at["K"], at["N"],
                                   at["block_size"], zp.dtype != np.uint8))
    return out


def test_pack_and_unpack_are_inverse_and_dequantise_to_the_same_weight():
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 16, (24, 96), dtype=np.uint8)
    d = rng.random((24, 3)).astype(np.float16).astype(np.float32)
    m = (-rng.random((24, 3)) * 8 * d).astype(np.float16).astype(np.float32)
    q, dd, mm = native.pack(codes, d, m)
    assert q.shape == (3, 3, 128) and dd.shape == (3, 3, 8) and dd.dtype == np.float16
    c2, d2, m2 = native.unpack(q, dd, mm)
    np.testing.assert_array_equal(c2, codes)
    np.testing.assert_array_equal(d2, d)
    np.testing.assert_array_equal(m2, m)
    want = (codes.reshape(24, 3, 32) * d[..., None] + m[..., None]).reshape(24, 96).T
    np.testing.assert_allclose(native.dequantize(q, dd, mm), want, rtol=0, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (8, 1), (2, 13)])
def test_the_op_computes_what_matmulnbits_did_on_the_same_hqq_weights(threads, shape):
    k, n_out = 576, [192, 576, 1536]
    hqq = _hqq(_model(k, n_out))
    swapped = onnx.ModelProto()
    swapped.CopyFrom(hqq)
    assert native.swap_model(swapped) == 3
    assert [n.op_type for n in swapped.graph.node] == ["Q4Gemv"] * 3
    assert not any(t.name in {n.input[1] for n in hqq.graph.node} for t in swapped.graph.initializer)
    x = np.random.default_rng(2).standard_normal((*shape, k)).astype(np.float32)
    ref = [x @ w for w in _weights(hqq)]  # the fp32 product of the float-zero-point weights
    mlas = _session(hqq, threads, False).run(None, {"x": x})
    ours = _session(swapped, threads, True).run(None, {"x": x})
    for r, a, b in zip(ref, mlas, ours):
        assert b.shape == r.shape
        scale = np.abs(r).max()
        # both quantise the activation to int8 in blocks of 32 (accuracy level 4): measured 3e-3 to 7e-3 each
        assert np.abs(a - r).max() / scale < 1e-2
        assert np.abs(b - r).max() / scale < 1e-2
        assert np.abs(b - a).max() / scale < 1.5e-2


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_eight_bit_weights_as_two_nibble_planes_compute_what_matmulnbits_did(threads):
    """The head at 8 bits (round to nearest, uint8 zero points): the same kernel over two nibble planes."""
    k, n_out = 576, [1536, 64]
    m8 = _nbits(_model(k, n_out, seed=3), 8, 32, 4, False, "rtn")
    swapped = onnx.ModelProto()
    swapped.CopyFrom(m8)
    assert native.swap_model(swapped) == 2
    assert all(a.i == 8 for n in swapped.graph.node for a in n.attribute if a.name == "bits")
    inits = {t.name: numpy_helper.to_array(t) for t in swapped.graph.initializer}
    x = np.random.default_rng(4).standard_normal((2, 5, k)).astype(np.float32)
    mlas = _session(m8, threads, False).run(None, {"x": x})
    ours = _session(swapped, threads, True).run(None, {"x": x})
    for node, a, b in zip(swapped.graph.node, mlas, ours):
        ref = x @ native.dequantize(*(inits[i] for i in node.input[1:]))
        # measured: 5e-3 against the fp32 product (int8 activations), 8e-4 against MatMulNBits
        assert np.abs(b - ref).max() / np.abs(ref).max() < 1e-2
        assert np.abs(b - a).max() / np.abs(a).max() < 3e-3


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
def test_a_graph_in_the_older_layout_computes_the_same(bits):
    """A graph llmpipe wrote before layout 2 (no `layout` attribute) is rewritten by the op when its kernel is
    created: the same outputs as the graph in layout 2, bit for bit (the same sums in the same order)."""
    m = _nbits(_model(576, [1536, 64], seed=6), bits, 32, 4, False, "hqq" if bits == 4 else "rtn")
    native.swap_model(m)
    assert all(any(a.name == "layout" and a.i == 2 for a in n.attribute) for n in m.graph.node)
    old = onnx.ModelProto()
    old.CopyFrom(m)
    assert as_layout_1(old) == 2
    x = np.random.default_rng(7).standard_normal((2, 5, 576)).astype(np.float32)
    for a, b in zip(_session(m, 2, True).run(None, {"x": x}), _session(old, 2, True).run(None, {"x": x})):
        np.testing.assert_array_equal(a, b)
    bad = onnx.ModelProto()
    bad.CopyFrom(m)
    bad.graph.node[0].attribute.append(helper.make_attribute("layout", 3))
    bad.graph.node[0].attribute.remove(next(a for a in bad.graph.node[0].attribute if a.name == "layout"))
    with pytest.raises(Exception, match="llmpipe.Q4Gemv: layout must be 1 or 2"):
        _session(bad, 1, True)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_create_session_registers_the_library_only_for_a_graph_that_uses_the_op(tmp_path, threads):
    """create_session registers the op with the session's thread count (the op then splits each matrix into
    one chunk per thread: 2 here for a matrix of 1536 x 576)."""
    hqq = _hqq(_model(576, [1536]))
    plain = tmp_path / "plain.onnx"
    onnx.save(hqq, str(plain))
    swapped = tmp_path / "swapped.onnx"
    assert native.swap_model(hqq) == 1
    onnx.save(hqq, str(swapped))
    assert not native.uses(plain) and native.uses(swapped)
    cpu = OrtProvider("cpu", "CPUExecutionProvider")
    x = np.random.default_rng(5).standard_normal((1, 3, 576)).astype(np.float32)
    a = create_session(plain, cpu, threads).run(None, {"x": x})[0]
    b = create_session(swapped, cpu, threads).run(None, {"x": x})[0]
    assert np.abs(a - b).max() / np.abs(a).max() < 1.5e-2


def test_nodes_the_op_cannot_take_stay_matmulnbits():
    model = _model(96, [20, 32])  # N = 20 is not whole tiles of 8
    q = _nbits(model, 4, 32, 4, False, "hqq")
    assert native.swap_model(q) == 1
    assert [n.op_type for n in q.graph.node] == ["MatMulNBits", "Q4Gemv"]
    eight = _nbits(_model(96, [32]), 8, 32, 4, False, "rtn")  # the 8-bit head's kind
    assert native.swap_model(eight, eight=False) == 0 and not native.uses(eight)
    two = _nbits(_model(96, [32]), 2, 32, 4, False, "rtn")  # a width the kernel has no planes for
    assert native.swap_model(two) == 0
    b64 = _nbits(_model(128, [32]), 4, 64, 4, False, "hqq")  # blocks of 64
    assert native.swap_model(b64) == 0


@needs_kernel
def test_an_input_that_does_not_fit_the_node_is_one_error_naming_the_op():
    hqq = _hqq(_model(64, [16]))
    native.swap_model(hqq)
    hqq.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 96
    sess = _session(hqq, 1, True)
    with pytest.raises(Exception, match="llmpipe.Q4Gemv: A's last dim is not K"):
        sess.run(None, {"x": np.ones((1, 1, 96), np.float32)})


def test_the_kernel_field_is_checked_when_the_config_loads():
    assert QuantizeSection().int4.kernel == "onnxruntime"
    ok = QuantizeSection.model_validate({"int4": {"kernel": "llmpipe"}}).int4
    assert ok.kernel == "llmpipe"
    # a separate adapter's rows go on the unfolded nodes as they are (llmpipe.infer.lora_rows)
    separate = QuantizeSection.model_validate({"int4": {"kernel": "llmpipe", "adapter": "separate"}}).int4
    assert separate.kernel == "llmpipe"
    for bad, word in (({"block_size": 64}, "blocks of 64"), ({"algorithm": "rtn"}, "rtn")):
        with pytest.raises(ValidationError, match=f"kernel=llmpipe: .*{word}"):
            QuantizeSection.model_validate({"int4": {"kernel": "llmpipe", **bad}})


def test_an_unbuildable_machine_says_why(monkeypatch):
    monkeypatch.setattr(native, "cpu_flags", lambda: {"sse2"})
    assert "AVX2" in native.unavailable()
    with pytest.raises(native.NativeUnavailable, match="lacks avx2, fma, f16c"):
        native.library()


def test_the_opset_domains_are_read_without_parsing_the_graph(tmp_path):
    """uses() on a path reads the ModelProto's opset imports from the wire format (every other field skipped):
    the same domains onnx itself reads; a file that is not a protobuf message is a ValueError, which
    register() leaves to onnxruntime's own load to report."""
    model = _hqq(_model(64, [16]))
    path = tmp_path / "m.onnx"
    onnx.save(model, str(path))
    assert native.opset_domains(path) == {o.domain for o in model.opset_import} == {"", "com.microsoft"}
    native.swap_model(model)
    onnx.save(model, str(path))
    assert native.opset_domains(path) == {"", "com.microsoft", "llmpipe"} and native.uses(path)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x0a\xff\xff\xff\x0f not a model")
    with pytest.raises(ValueError, match="not an ONNX model"):
        native.opset_domains(bad)
    opts = ort.SessionOptions()
    native.register(opts, bad)  # nothing registered, nothing raised


def test_the_kernel_field_moves_the_benchmarks_fingerprint_only_when_set(tmp_path):
    """`kernel` is an added result field (it decides the int4 graph): a config that never named it, or names the
    default, hashes as before (a finished benchmark is not re-run by the upgrade); kernel llmpipe moves the
    benchmark's fingerprint and no earlier stage's."""
    from llmpipe.config import from_dict
    from llmpipe.stages import fingerprints

    base = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
            "export": {"ort_graph": True}, "benchmark": {"variants": ["fp32", "int4"]}}

    def with_int4(**int4):
        return fingerprints(from_dict({**base, "benchmark": {**base["benchmark"], "quantize": {"int4": int4}}}))

    before = fingerprints(from_dict(base))
    assert with_int4(kernel="onnxruntime") == before
    ours = with_int4(kernel="llmpipe", algorithm="hqq", block_size=32)
    plain = with_int4(algorithm="hqq", block_size=32)
    assert ours["benchmark"] != plain["benchmark"]
    assert {k: v for k, v in ours.items() if k != "benchmark"} == {k: v for k, v in plain.items() if k != "benchmark"}
