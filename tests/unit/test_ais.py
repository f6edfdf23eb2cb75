"""llmpipe.infer.ais: OM models through ais_bench, checked against tests/fakes/ais_bench_pkg, a
stand-in for Ascend's ais_bench (which needs CANN and an NPU, so cannot exist here) that runs the
.om files of tests/fakes/atc with onnxruntime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from llmpipe.infer import ais

FAKES = Path(__file__).resolve().parents[1] / "fakes"
FAKE_PKG = FAKES / "ais_bench_pkg"
OM_MAGIC = "LLMPIPE-FAKE-OM v1"


def _forget_ais_bench(monkeypatch) -> None:
    """Drop ais_bench modules imported by an earlier test (restored when this test ends)."""
    for name in [n for n in sys.modules if n == "ais_bench" or n.startswith("ais_bench.")]:
        monkeypatch.delitem(sys.modules, name)


@pytest.fixture
def fake_ais(monkeypatch):
    _forget_ais_bench(monkeypatch)
    monkeypatch.syspath_prepend(str(FAKE_PKG))


@pytest.fixture
def no_ais(monkeypatch):
    _forget_ais_bench(monkeypatch)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if Path(p or ".").resolve() != FAKE_PKG])


@pytest.fixture
def onnx_model(tmp_path) -> Path:
    """input_ids int64 (batch, seq) and bias float32 (batch, seq) -> sum = float(ids) + bias (float32),
    next_ids = ids + 1 (int64)."""
    ids = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
    bias = helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["batch", "seq"])
    total = helper.make_tensor_value_info("sum", TensorProto.FLOAT, ["batch", "seq"])
    nxt = helper.make_tensor_value_info("next_ids", TensorProto.INT64, ["batch", "seq"])
    one = helper.make_tensor("one", TensorProto.INT64, [], [1])
    nodes = [helper.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["ids_f", "bias"], ["sum"]),
             helper.make_node("Add", ["input_ids", "one"], ["next_ids"])]
    graph = helper.make_graph(nodes, "tiny", [ids, bias], [total, nxt], initializer=[one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path / "tiny.onnx"
    onnx.save(model, str(path))
    return path


def write_om(path: Path, onnx_path: Path, input_shape: str | None, dynamic_dims: str | None = None) -> Path:
    """An .om in the format tests/fakes/atc writes (LLMPIPE-FAKE-OM v1)."""
    spec = {"onnx": str(onnx_path.resolve()), "input_shape": input_shape, "dynamic_dims": dynamic_dims,
            "soc_version": "Ascend910B1"}
    path.write_text(f"{OM_MAGIC}\n{json.dumps(spec)}\n", encoding="utf-8")
    return path


@pytest.fixture
def static_om(tmp_path, onnx_model) -> Path:
    return write_om(tmp_path / "static.om", onnx_model, "input_ids:1,4;bias:1,4")


@pytest.fixture
def gears_om(tmp_path, onnx_model) -> Path:
    return write_om(tmp_path / "gears.om", onnx_model, "input_ids:1,-1;bias:1,-1", "4,4;8,8")


def feeds(seq: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1000, (1, seq), dtype=np.int64),
            "bias": rng.standard_normal((1, seq)).astype(np.float32)}


def test_an_om_session_runs_a_static_model_and_matches_onnxruntime_exactly(fake_ais, static_om, onnx_model):
    x = feeds()
    session = ais.OmSession(static_om)
    assert session.mode == "static"
    assert session.input_names == ["input_ids", "bias"] and session.output_names == ["sum", "next_ids"]
    got = session.run(None, x)
    want = ort.InferenceSession(str(onnx_model), providers=["CPUExecutionProvider"]).run(None, x)
    assert len(got) == 2
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def test_outputs_are_selected_by_name_in_the_order_asked(fake_ais, static_om):
    x = feeds()
    session = ais.OmSession(static_om)
    next_ids, total = session.run(["next_ids", "sum"], x)
    np.testing.assert_array_equal(next_ids, x["input_ids"] + 1)
    np.testing.assert_array_equal(total, x["input_ids"].astype(np.float32) + x["bias"])
    (only,) = session.run(["sum"], x)
    np.testing.assert_array_equal(only, total)


def test_feeds_are_reordered_to_the_models_input_order(fake_ais, static_om, monkeypatch):
    x = feeds()
    session = ais.OmSession(static_om)
    seen = []
    infer = session._session.infer
    monkeypatch.setattr(session._session, "infer", lambda arrays, mode: seen.append(arrays) or infer(arrays, mode))
    reversed_feeds = {"bias": x["bias"], "input_ids": x["input_ids"]}
    (total,) = session.run(["sum"], reversed_feeds)
    assert [a.dtype for a in seen[0]] == [np.int64, np.float32]
    np.testing.assert_array_equal(total, x["input_ids"].astype(np.float32) + x["bias"])


def test_a_wrong_shape_is_refused_naming_the_input_and_both_shapes(fake_ais, static_om):
    session = ais.OmSession(static_om)
    with pytest.raises(ValueError, match=r"^static\.om: input 'bias' expects shape \(1, 4\), got \(1, 5\)$"):
        session.run(None, {**feeds(), "bias": np.zeros((1, 5), np.float32)})
    with pytest.raises(ValueError, match=r"input 'input_ids' expects shape \(1, 4\), got \(4,\)$"):
        session.run(None, {**feeds(), "input_ids": np.zeros(4, np.int64)})


def test_a_wrong_dtype_is_refused_naming_the_input_and_both_dtypes(fake_ais, static_om):
    session = ais.OmSession(static_om)
    with pytest.raises(ValueError, match=r"^static\.om: input 'input_ids' expects int64, got int32$"):
        session.run(None, {**feeds(), "input_ids": np.zeros((1, 4), np.int32)})


def test_a_wrong_dtype_of_the_same_size_would_run_on_the_om_itself(fake_ais, static_om):
    """Why OmSession checks dtypes: an OM takes bytes, so float64 ids (8 bytes, like int64) run."""
    from ais_bench.infer.interface import InferSession

    raw = InferSession(0, str(static_om))
    ids = np.arange(4, dtype=np.float64).reshape(1, 4)
    total, _ = raw.infer([ids, np.zeros((1, 4), np.float32)], mode="static")
    assert not np.array_equal(total, ids.astype(np.float32))


def test_a_missing_or_unknown_input_or_output_is_refused_by_name(fake_ais, static_om):
    session = ais.OmSession(static_om)
    x = feeds()
    with pytest.raises(ValueError, match=r"^static\.om: input 'bias' is missing \(the model's inputs: "
                                         r"input_ids, bias\)$"):
        session.run(None, {"input_ids": x["input_ids"]})
    with pytest.raises(ValueError, match=r"^static\.om: no input named 'mask' \(the model's inputs: "):
        session.run(None, {**x, "mask": x["input_ids"]})
    with pytest.raises(ValueError, match=r"^static\.om: no output named 'logits' \(the model's outputs: "
                                         r"sum, next_ids\)$"):
        session.run(["logits"], x)


def test_a_model_compiled_with_gears_runs_each_gear_in_dymdims_mode(fake_ais, gears_om, onnx_model):
    session = ais.OmSession(gears_om)
    assert session.mode == "dymdims"  # detected from the -1 dims
    reference = ort.InferenceSession(str(onnx_model), providers=["CPUExecutionProvider"])
    for seq in (4, 8):
        x = feeds(seq, seed=seq)
        for g, w in zip(session.run(None, x), reference.run(None, x)):
            np.testing.assert_array_equal(g, w)


def test_a_shape_between_gears_is_refused(fake_ais, gears_om):
    session = ais.OmSession(gears_om)
    with pytest.raises(ValueError, match=r"^gears\.om: ais_bench refused input shapes input_ids \(1, 5\), "
                                         r"bias \(1, 5\) in mode dymdims .*match no gear of the model \(4,4;8,8\)"):
        session.run(None, feeds(5))
    with pytest.raises(ValueError, match=r"^gears\.om: input 'input_ids' expects shape \(1, -1\) \(-1: a dim the "
                                         r"model's gears set\), got \(2, 4\)$"):
        session.run(None, {**feeds(4), "input_ids": np.zeros((2, 4), np.int64)})


def test_the_fake_refuses_other_shapes_the_way_a_static_om_does(fake_ais, static_om):
    from ais_bench.infer.interface import InferSession

    raw = InferSession(0, str(static_om))
    x = feeds(8)
    with pytest.raises(RuntimeError, match=r"input 0 \(input_ids\) size 64 bytes does not match the model's 32"):
        raw.infer([x["input_ids"], x["bias"]], mode="static")
    with pytest.raises(RuntimeError, match="compiled without dynamic_dims"):
        raw.infer([x["input_ids"], x["bias"]], mode="dymdims")


def test_a_file_that_is_not_an_om_model_fails_to_load(fake_ais, tmp_path):
    bad = tmp_path / "bad.om"
    bad.write_bytes(b"\x00\x01 not a model\n")
    with pytest.raises(RuntimeError, match=r"load model from file failed, model file is .*bad\.om"):
        ais.OmSession(bad)
    with pytest.raises(FileNotFoundError, match="no OM model at"):
        ais.OmSession(tmp_path / "absent.om")


def test_the_fake_runs_what_the_fake_atc_writes(fake_ais, tmp_path, onnx_model):
    argv = [sys.executable, str(FAKES / "atc"), "--framework=5", f"--model={onnx_model}",
            f"--output={tmp_path / 'model'}", "--soc_version=Ascend910B1", "--input_format=ND",
            "--input_shape=input_ids:1,-1;bias:1,-1", "--dynamic_dims=4,4;8,8"]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    session = ais.OmSession(tmp_path / "model.om")
    x = feeds(8)
    (next_ids,) = session.run(["next_ids"], x)
    np.testing.assert_array_equal(next_ids, x["input_ids"] + 1)


def test_unavailable_reason_says_not_installed_without_ais_bench(no_ais):
    assert ais.unavailable_reason() == ("ais_bench not installed (pip package from Ascend/tools: "
                                        "ais-bench_workload/tool/ais_bench, with its aclruntime backend)")
    with pytest.raises(ais.AisUnavailable, match="^ais_bench not installed"):
        ais.OmSession("model.om")


def test_unavailable_reason_is_none_when_ais_bench_is_importable(fake_ais):
    assert ais.unavailable_reason() is None


def test_time_om_returns_iters_positive_durations_and_the_device_times(fake_ais, static_om):
    session = ais.OmSession(static_om)
    times = ais.time_om(session, feeds(), warmup=2, iters=5)
    assert set(times) == {"wall_s", "device_s"}
    assert len(times["wall_s"]) == 5 and all(t > 0 for t in times["wall_s"])
    assert len(times["device_s"]) == 5 and all(0 < d <= w for d, w in zip(times["device_s"], times["wall_s"]))
    with pytest.raises(ValueError, match="iters must be >= 1"):
        ais.time_om(session, feeds(), warmup=0, iters=0)


def test_close_frees_the_model_once_and_a_closed_session_refuses_to_run(fake_ais, static_om):
    session = ais.OmSession(static_om)
    raw = session._session
    with session:
        session.run(None, feeds())
    assert raw.freed
    session.close()  # idempotent
    with pytest.raises(RuntimeError, match=r"^static\.om: the session is closed$"):
        session.run(None, feeds())


def test_an_om_model_fed_an_input_it_does_not_have_is_a_user_error(fake_ais, static_om):
    from llmpipe.errors import UserError

    x = feeds()
    with pytest.raises(ais.OmInputError, match=r"^static\.om: no input named 'mask' \(the model's inputs: ") as err:
        ais.OmSession(static_om).run(None, {**x, "mask": x["input_ids"]})
    assert isinstance(err.value, UserError)
