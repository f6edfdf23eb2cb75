"""convert_om (llmpipe.export.atc): argv builder, ATC discovery, error parsing, and the stage run
against tests/fakes/atc, a script standing in for CANN's `atc` (which cannot exist here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from llmpipe import config, stages
from llmpipe.config import ConvertOmSection
from llmpipe.export import atc
from llmpipe.manifest import Manifest, file_entry
from llmpipe.stages import StageContext, StageError

FAKES = Path(__file__).resolve().parents[1] / "fakes"
FAKE_ATC = FAKES / "atc"
LAYERS, KV_HEADS, HEAD_DIM, CACHE, VOCAB = 2, 1, 4, 8, 16  # the tiny graphs below
GEARS = {"input_shape": "input_ids:1,-1", "dynamic_dims": "16;32"}  # a prefill config that compiles
DECODER_SHAPE = ("input_ids:1,1;position_ids:1,1;attention_mask:1,8;cache.0.key:1,1,8,4;"
                 "cache.0.value:1,1,8,4;cache.1.key:1,1,8,4;cache.1.value:1,1,8,4")

E10001_LOG = """\
ATC start working now, please wait for a moment.
W11001: Op [MatMul_3] does not hit the high-priority operator information library.
ATC run failed, Please check the detail log, Try 'atc --help' for more information
E10001: Value [linux] for parameter [--framework] is invalid. Reason: The value is not supported.
        Solution: try again with a valid argument.
        TraceBack (most recent call last):
        E19999: an internal code inside the traceback, not a block of its own
        Solution: not this one either
"""

EZ3003_LOG = """\
ATC run failed, Please check the detail log, Try 'atc --help' for more information
EZ3003: No supported Ops kernel and engine are found for [MatMulV2], optype [MatMulV2].
        Possible Cause: The operator is not supported by the system.
        Solution: 1. Check that the OPP component is installed properly.
        TraceBack (most recent call last):
        Assert ((SelectEngine(node_ptr)) == ge::SUCCESS) failed[FUNC:InferShapeAndType]
E19010: No parser is registered for Op [Foo], optype [Foo].
ERROR: not a code, only shouting
"""


@pytest.fixture(autouse=True)
def _no_real_cann(tmp_path, monkeypatch):
    """Keep a real CANN install (and the torch import behind llmpipe.device) out of every test."""
    monkeypatch.setattr(atc, "_toolkit_dirs", lambda: [str(tmp_path / "cann" / "latest")])
    for var in ("FAKE_ATC_MODE", "FAKE_ATC_RECORD"):
        monkeypatch.delenv(var, raising=False)


@pytest.fixture
def no_path_atc(tmp_path, monkeypatch):
    """PATH without any `atc` on it."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


@pytest.fixture
def python_on_path(monkeypatch):
    """The fake's `#!/usr/bin/env python3` finds this interpreter whatever PATH a machine has."""
    here = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join([here, os.environ.get("PATH", "")]))


def make_cfg(tmp_path: Path, **convert_om) -> config.RunConfig:
    return config.from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts")},
                             "data": {"inputs": ["x"]}, "convert_om": convert_om})


def _tensor(name: str, dtype: int, dims: list) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, dims)


def _graph(path: Path, inputs: list, outputs: list) -> Path:
    """A valid ONNX model with these declared inputs and outputs; every output is input 0 cast to
    float (the values do not matter: ATC is faked)."""
    nodes = [helper.make_node("Cast", [inputs[0].name], ["x"], to=TensorProto.FLOAT)]
    nodes += [helper.make_node("Identity", ["x"], [o.name]) for o in outputs]
    model = helper.make_model(helper.make_graph(nodes, path.stem, inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def prefill_onnx(path: Path, ids_dims: tuple = ("batch", "seq")) -> Path:
    """export_onnx's model.onnx: input_ids (batch, seq) -> logits, present.{i}.key/value."""
    kv = ["batch", KV_HEADS, "seq", HEAD_DIM]
    present = [_tensor(f"present.{i}.{t}", TensorProto.FLOAT, kv) for i in range(LAYERS) for t in ("key", "value")]
    return _graph(path, [_tensor("input_ids", TensorProto.INT64, list(ids_dims))],
                  [_tensor("logits", TensorProto.FLOAT, ["batch", "seq", VOCAB]), *present])


def decoder_onnx(path: Path, cache_dim: int | str = CACHE) -> Path:
    """export_onnx's decoder_static.onnx: ids, positions, mask and a fixed cache -> logits, new k/v."""
    cache = ["batch", KV_HEADS, cache_dim, HEAD_DIM]
    inputs = [_tensor("input_ids", TensorProto.INT64, ["batch", "chunk"]),
              _tensor("position_ids", TensorProto.INT64, ["batch", "chunk"]),
              _tensor("attention_mask", TensorProto.INT64, ["batch", cache_dim])]
    inputs += [_tensor(f"cache.{i}.{t}", TensorProto.FLOAT, cache) for i in range(LAYERS) for t in ("key", "value")]
    outputs = [_tensor("logits", TensorProto.FLOAT, ["batch", "chunk", VOCAB])]
    outputs += [_tensor(f"new.{i}.{t}", TensorProto.FLOAT, ["batch", KV_HEADS, "chunk", HEAD_DIM])
                for i in range(LAYERS) for t in ("key", "value")]
    return _graph(path, inputs, outputs)


def export_folder(folder: Path, decoder: bool = True, **graph) -> dict:
    """model.onnx (and decoder_static.onnx) in `folder`; their manifest outputs."""
    folder.mkdir(parents=True)
    outputs = {"model": file_entry(folder, prefill_onnx(folder / "model.onnx", **graph).name)}
    if decoder:
        outputs["decoder_static"] = file_entry(folder, decoder_onnx(folder / "decoder_static.onnx").name)
    return outputs


def make_ctx(tmp_path: Path, decoder_graph: bool = True, cfg: config.RunConfig | None = None,
             **convert_om) -> StageContext:
    """A StageContext whose export_onnx input holds tiny model.onnx and (unless `decoder_graph` is
    false) decoder_static.onnx graphs with export's input names and dims."""
    cfg = cfg or make_cfg(tmp_path, **convert_om)
    folder = tmp_path / "04_export_onnx"
    manifest = Manifest(stage="export_onnx", status="completed", fingerprint="x",
                        outputs=export_folder(folder, decoder_graph))
    work = tmp_path / ".05_convert_om.partial"
    work.mkdir()
    return StageContext(cfg, "convert_om", tmp_path, work, {"export_onnx": (folder, manifest)}, "fp")


def recorded(path: Path) -> list[list[str]]:
    """The fake ATC's FAKE_ATC_RECORD: one argv per run."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def fake_om(path: Path) -> dict:
    """The fake ATC's .om: a magic line, then one JSON line."""
    magic, spec, *rest = path.read_text().split("\n")
    assert magic == "LLMPIPE-FAKE-OM v1" and rest == [""]
    return json.loads(spec)


# --------------------------------------------------------------------------- build_argv


def test_build_argv_typical_config():
    section = ConvertOmSection(soc_version="Ascend910B", input_shape="input_ids:1,-1",
                               dynamic_dims="32;64;128", precision_mode_v2="fp16",
                               op_select_implmode="high_performance", log="error")
    assert atc.build_argv(section, "/opt/atc", Path("/m/model.onnx"), Path("/w/model")) == [
        "/opt/atc", "--framework=5", "--model=/m/model.onnx", "--output=/w/model", "--soc_version=Ascend910B",
        "--input_format=ND", "--input_shape=input_ids:1,-1", "--dynamic_dims=32;64;128",
        "--precision_mode_v2=fp16", "--op_select_implmode=high_performance", "--log=error",
    ]


def test_build_argv_defaults_and_precision_mode_v1():
    assert atc.build_argv(ConvertOmSection(), "atc", "m.onnx", "out") == [
        "atc", "--framework=5", "--model=m.onnx", "--output=out", "--soc_version=Ascend910B",
        "--input_format=ND", "--precision_mode_v2=fp16", "--log=error"]
    v1 = ConvertOmSection(precision_mode="allow_fp32_to_fp16", precision_mode_v2=None, log="info")
    argv = atc.build_argv(v1, "atc", "m.onnx", "out")
    assert "--precision_mode=allow_fp32_to_fp16" in argv
    assert not any(a.startswith("--precision_mode_v2") for a in argv)
    assert argv[-1] == "--log=info"


def test_precision_modes_are_exclusive():
    with pytest.raises(config.ConfigError, match="precision_mode or precision_mode_v2"):
        config.from_dict({"data": {"inputs": ["x"]},
                          "convert_om": {"precision_mode": "force_fp16", "precision_mode_v2": "fp16"}})
    fields = {**ConvertOmSection().model_dump(), "precision_mode": "force_fp16"}
    both = ConvertOmSection.model_construct(**fields)  # skips the validator, as a hand-built section could
    with pytest.raises(ValueError, match="not both"):
        atc.build_argv(both, "atc", "m.onnx", "out")


def test_dynamic_dims_over_several_inputs():
    section = ConvertOmSection(input_shape="input_ids:1,-1;attention_mask:1,-1", dynamic_dims="32,32;64,64")
    assert "--dynamic_dims=32,32;64,64" in atc.build_argv(section, "atc", "m.onnx", "out")


@pytest.mark.parametrize("input_shape, dynamic_dims, expected", [
    (None, "32;64", r"convert_om.dynamic_dims \('32;64'\) needs convert_om.input_shape"),
    ("input_ids:1,128", "32;64", "'input_ids:1,128' has none"),
    ("input_ids:1,-1", "32,1;64,1", r"gear 1 \('32,1'\) has 2 values, but convert_om.input_shape "
                                    "'input_ids:1,-1' has 1 -1 dims"),
    ("input_ids:-1,-1", "32;64", r"gear 1 \('32'\) has 1 values, .* has 2 -1 dims"),
    ("input_ids:1,-1", "32", "ATC takes 2 to 100 gears, got 1"),
    ("input_ids:1,-1", "32;x", r"gear 2 \('x'\) must be positive integers"),
])
def test_dynamic_dims_validation(input_shape, dynamic_dims, expected):
    section = ConvertOmSection(input_shape=input_shape, dynamic_dims=dynamic_dims)
    with pytest.raises(ValueError, match=expected):
        atc.build_argv(section, "atc", "m.onnx", "out")


# --------------------------------------------------------------------------- find_atc


def test_find_atc_via_atc_path(tmp_path):
    assert atc.find_atc(ConvertOmSection(atc_path=str(FAKE_ATC))) == str(FAKE_ATC)
    plain = tmp_path / "atc"
    plain.write_text("not executable")
    for bad in (plain, tmp_path / "missing"):
        with pytest.raises(StageError, match="convert_om.atc_path"):
            atc.find_atc(ConvertOmSection(atc_path=str(bad)))


def test_find_atc_via_path(monkeypatch):
    monkeypatch.setenv("PATH", str(FAKES))
    assert atc.find_atc(ConvertOmSection()) == str(FAKE_ATC)


def test_find_atc_in_cann_toolkit(tmp_path, no_path_atc):
    binary = tmp_path / "cann" / "latest" / "compiler" / "bin" / "atc"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert atc.find_atc(ConvertOmSection()) == str(binary)


def test_find_atc_none_when_absent(no_path_atc):
    assert atc.find_atc(ConvertOmSection()) is None


def test_fingerprint_extra(tmp_path, monkeypatch, no_path_atc):
    assert atc.fingerprint_extra(make_cfg(tmp_path)) == {"atc": None}
    assert atc.fingerprint_extra(make_cfg(tmp_path, atc_path=str(tmp_path / "gone"))) == {"atc": None}
    link = tmp_path / "bin" / "atc"
    link.parent.mkdir()
    link.symlink_to(FAKE_ATC)  # like CANN's ascend-toolkit/latest -> <version>
    monkeypatch.setenv("PATH", str(link.parent))
    assert atc.fingerprint_extra(make_cfg(tmp_path)) == {"atc": os.path.realpath(FAKE_ATC)}


# --------------------------------------------------------------------------- parse_errors


def test_parse_errors_e10001_block_without_traceback():
    assert atc.parse_errors(E10001_LOG) == [atc.AtcError(
        "E10001", "Value [linux] for parameter [--framework] is invalid. Reason: The value is not supported.",
        "try again with a valid argument.")]


def test_parse_errors_several_blocks():
    errors = atc.parse_errors(EZ3003_LOG)
    assert [e.code for e in errors] == ["EZ3003", "E19010"]
    assert errors[0].message == ("No supported Ops kernel and engine are found for [MatMulV2], "
                                 "optype [MatMulV2].")
    assert errors[0].solution == "1. Check that the OPP component is installed properly."
    assert errors[1].solution == ""
    assert str(errors[1]) == "E19010: No parser is registered for Op [Foo], optype [Foo]."


def test_failure_summary_without_code_is_last_line():
    assert atc.failure_summary("ATC start working now\nSegmentation fault (core dumped)\n\n") == \
        "Segmentation fault (core dumped)"
    assert atc.failure_summary("") == "(ATC printed nothing)"


# --------------------------------------------------------------------------- the fake itself


@pytest.mark.parametrize("extra, reason", [
    (["--bogus=1"], "parameter [--bogus] is invalid"),
    (["--precision_mode=force_fp16", "--precision_mode_v2=fp16"], "cannot be configured at the same time"),
])
def test_fake_atc_rejects_like_atc(tmp_path, python_on_path, extra, reason):
    onnx = tmp_path / "m.onnx"
    onnx.write_bytes(b"x")
    argv = [str(FAKE_ATC), "--framework=5", f"--model={onnx}", f"--output={tmp_path / 'o'}",
            "--soc_version=Ascend910B", *extra]
    code, text = atc.run_atc(argv, tmp_path / "atc.log", timeout_s=60)
    assert code == 1
    assert atc.parse_errors(text)[0].code == "E10001"
    assert reason in atc.failure_summary(text)


# --------------------------------------------------------------------------- the graphs' shapes


def test_graph_inputs_reads_the_declared_inputs_without_the_weights(tmp_path):
    model = onnx.load(str(prefill_onnx(tmp_path / "src.onnx")))
    model.graph.initializer.append(numpy_helper.from_array(np.full((64, 64), 0.5, np.float32), "w"))
    model.graph.input.append(_tensor("w", TensorProto.FLOAT, [64, 64]))  # old-style: weights listed as inputs
    onnx.save(model, str(tmp_path / "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=0)
    (tmp_path / "model.onnx.data").unlink()  # the weights are never read
    assert atc.graph_inputs(tmp_path / "model.onnx") == {"input_ids": ["batch", "seq"]}


def test_decoder_input_shape_fixes_batch_and_chunk_and_keeps_the_fixed_dims(tmp_path):
    inputs = atc.graph_inputs(decoder_onnx(tmp_path / "decoder_static.onnx"))
    assert atc.decoder_input_shape(ConvertOmSection(), inputs, "d.onnx") == DECODER_SHAPE
    shape = atc.decoder_input_shape(ConvertOmSection(decode_batch=4, decode_chunk=2), inputs, "d.onnx")
    assert shape.startswith("input_ids:4,2;position_ids:4,2;attention_mask:4,8;cache.0.key:4,1,8,4;")


def test_an_input_shape_that_leaves_a_symbolic_input_open_is_refused():
    inputs = {"input_ids": ["batch", "seq"], "attention_mask": ["batch", "seq"]}
    with pytest.raises(ValueError) as err:
        atc.check_prefill(ConvertOmSection(input_shape="input_ids:1,16"), inputs, "model.onnx")
    assert str(err.value) == ("convert_om.input_shape 'input_ids:1,16' leaves out model.onnx's inputs with "
                              "symbolic dims (attention_mask: batch,seq): set input_shape with fixed dims, "
                              "or -1 dims plus dynamic_dims gears")


def test_a_minus_one_dim_without_gears_is_refused_when_the_config_loads(tmp_path):
    with pytest.raises(config.ConfigError, match=r"^config: convert_om.input_shape 'input_ids:1,-1' has -1 dims but "
                       r"convert_om.dynamic_dims is null: ATC needs gears"):
        make_cfg(tmp_path, input_shape="input_ids:1,-1")


# --------------------------------------------------------------------------- run(ctx)


def test_without_atc_the_stage_is_skipped_saying_neither_graph_was_converted(tmp_path, no_path_atc):
    result = atc.run(make_ctx(tmp_path))
    assert result.status == "skipped" and result.outputs == {}
    assert "ATC (CANN toolkit) not found on PATH or in" in result.reason
    assert "model.om and decoder.om were not built;" in result.reason
    assert str(tmp_path / "cann" / "latest") in result.reason
    assert "convert_om.required: true" in result.reason
    assert result.metrics == {"graphs": {"model": "skipped", "decoder": "skipped"}}


def test_without_atc_and_without_the_decoder_only_model_om_is_named(tmp_path, no_path_atc):
    result = atc.run(make_ctx(tmp_path, decoder=False))
    assert "model.om was not built;" in result.reason and "decoder" not in result.reason
    assert result.metrics == {"graphs": {"model": "skipped"}}


def test_run_required_but_absent_fails(tmp_path, no_path_atc):
    with pytest.raises(StageError, match="convert_om.required is true but ATC was not found"):
        atc.run(make_ctx(tmp_path, required=True))


def test_both_graphs_are_compiled_each_with_its_own_argv_log_and_om(tmp_path, monkeypatch, python_on_path):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_ATC_RECORD", str(record))
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), **GEARS)
    result = atc.run(ctx)

    assert result.status == "completed"
    assert result.outputs == {"om": "model.om", "log": "model.atc.log", "argv": "model.argv.json",
                              "decoder_om": "decoder.om", "decoder_log": "decoder.atc.log",
                              "decoder_argv": "decoder.argv.json"}
    export, work = (tmp_path / "04_export_onnx").resolve(), ctx.work_dir.resolve()
    prefill = atc.build_argv(ctx.cfg.convert_om, str(FAKE_ATC), export / "model.onnx", work / "model")
    decoder = atc.build_argv(ctx.cfg.convert_om.model_copy(update={"input_shape": DECODER_SHAPE, "dynamic_dims": None}),
                             str(FAKE_ATC), export / "decoder_static.onnx", work / "decoder")
    assert json.loads((work / "model.argv.json").read_text()) == prefill
    assert json.loads((work / "decoder.argv.json").read_text()) == decoder
    assert recorded(record) == [prefill, decoder]  # one ATC run per graph, prefill first
    assert f"--input_shape={DECODER_SHAPE}" in decoder and not any(a.startswith("--dynamic_dims") for a in decoder)
    for name in ("model", "decoder"):
        assert "ATC run success" in (work / f"{name}.atc.log").read_text()
        graph = result.metrics["graphs"][name]
        assert graph["om_bytes"] == (work / f"{name}.om").stat().st_size
        assert graph["argv"] == {"model": prefill, "decoder": decoder}[name] and graph["seconds"] >= 0
    assert result.metrics["atc"] == str(FAKE_ATC) and "skipped" not in result.metrics


def test_the_fake_om_names_the_onnx_file_and_the_shapes_it_was_compiled_for(tmp_path, python_on_path):
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), soc_version="Ascend310P3", **GEARS)
    atc.run(ctx)
    export = (tmp_path / "04_export_onnx").resolve()
    assert fake_om(ctx.work_dir / "model.om") == {"onnx": str(export / "model.onnx"), "input_shape": "input_ids:1,-1",
                                                  "dynamic_dims": "16;32", "soc_version": "Ascend310P3"}
    assert fake_om(ctx.work_dir / "decoder.om") == {"onnx": str(export / "decoder_static.onnx"),
                                                    "input_shape": DECODER_SHAPE, "dynamic_dims": None,
                                                    "soc_version": "Ascend310P3"}


def test_decode_batch_and_chunk_shape_the_decoder(tmp_path, python_on_path):
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), decode_batch=4, decode_chunk=3, **GEARS)
    atc.run(ctx)
    shape = fake_om(ctx.work_dir / "decoder.om")["input_shape"]
    assert shape == ("input_ids:4,3;position_ids:4,3;attention_mask:4,8;cache.0.key:4,1,8,4;"
                     "cache.0.value:4,1,8,4;cache.1.key:4,1,8,4;cache.1.value:4,1,8,4")
    assert fake_om(ctx.work_dir / "model.om")["input_shape"] == "input_ids:1,-1"  # the prefill keeps its own


def test_the_tiny_config_compiles_the_prefill_with_gears_and_the_decoder(tmp_path, monkeypatch, python_on_path):
    tiny = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"
    cfg = config.load(tiny, [f"run.artifacts_dir={tmp_path}", f"convert_om.atc_path={FAKE_ATC}"])
    ctx = make_ctx(tmp_path, cfg=cfg)
    assert atc.run(ctx).status == "completed"
    assert fake_om(ctx.work_dir / "model.om")["dynamic_dims"] == "32;64;128;256;512"
    assert fake_om(ctx.work_dir / "decoder.om")["input_shape"] == DECODER_SHAPE


def test_a_prefill_with_fixed_dims_needs_no_input_shape(tmp_path, python_on_path):
    cfg = make_cfg(tmp_path, atc_path=str(FAKE_ATC), decoder=False)
    folder = tmp_path / "04_export_onnx"
    manifest = Manifest(stage="export_onnx", status="completed", fingerprint="x",
                        outputs=export_folder(folder, decoder=False, ids_dims=(1, 128)))
    (tmp_path / "work").mkdir()
    ctx = StageContext(cfg, "convert_om", tmp_path, tmp_path / "work", {"export_onnx": (folder, manifest)}, "fp")
    result = atc.run(ctx)
    assert set(result.outputs) == {"om", "log", "argv"} and list(result.metrics["graphs"]) == ["model"]
    assert fake_om(ctx.work_dir / "model.om")["input_shape"] is None


def test_a_decoder_missing_from_the_export_converts_the_prefill_and_says_why(tmp_path, python_on_path, caplog):
    ctx = make_ctx(tmp_path, decoder_graph=False, atc_path=str(FAKE_ATC), **GEARS)
    with caplog.at_level("WARNING", logger="llmpipe.atc"):
        result = atc.run(ctx)
    assert result.status == "completed" and set(result.outputs) == {"om", "log", "argv"}
    why = ("export_onnx published no decoder_static (export.static_decoder false, or an older export), so "
           "decoder.om was not built; set convert_om.decoder: false to silence this")
    assert result.metrics["graphs"]["decoder"] == "skipped" and result.metrics["skipped"] == {"decoder": why}
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [f"convert_om: {why}"]
    assert not (ctx.work_dir / "decoder.om").exists()


def test_decoder_false_compiles_the_prefill_only_without_a_warning(tmp_path, python_on_path, caplog):
    with caplog.at_level("WARNING", logger="llmpipe.atc"):
        result = atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), decoder=False, **GEARS))
    assert set(result.outputs) == {"om", "log", "argv"} and list(result.metrics["graphs"]) == ["model"]
    assert "skipped" not in result.metrics and not caplog.records


@pytest.mark.parametrize("convert_om, message", [
    ({"input_shape": "ids:1,16"},
     "convert_om.input_shape: 'ids:1,16' names input 'ids', which model.onnx does not have (its inputs: input_ids)"),
    ({"input_shape": "input_ids:16"},
     "convert_om.input_shape: 'input_ids:16' gives 1 dims, but model.onnx's input_ids has 2 (batch,seq)"),
    ({"input_shape": "input_ids:1,2,-1", "dynamic_dims": "16;32"},
     "convert_om.input_shape: 'input_ids:1,2,-1' gives 3 dims, but model.onnx's input_ids has 2 (batch,seq)"),
    ({}, "convert_om.input_shape is null, but model.onnx has symbolic dims (input_ids: batch,seq): set input_shape "
         "with fixed dims, or -1 dims plus dynamic_dims gears"),
])
def test_a_shape_the_prefill_graph_cannot_take_is_refused_before_atc_runs(tmp_path, monkeypatch, python_on_path,
                                                                          convert_om, message):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_ATC_RECORD", str(record))
    with pytest.raises(StageError) as err:
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), **convert_om))
    assert str(err.value) == message
    assert not record.exists()


def test_a_minus_one_dim_without_gears_is_refused_by_the_stage_too(tmp_path, monkeypatch, python_on_path):
    monkeypatch.setattr("llmpipe.config_checks.check_atc", lambda cfg: None)  # as a fields-only config
    with pytest.raises(StageError) as err:
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), input_shape="input_ids:1,-1"))
    assert str(err.value) == ("convert_om.input_shape 'input_ids:1,-1' has -1 dims but convert_om.dynamic_dims is "
                              "null: ATC needs gears (e.g. dynamic_dims '16;32;64') or fixed dims")


def test_a_decoder_with_another_symbolic_dim_is_refused_before_atc_runs(tmp_path, monkeypatch, python_on_path):
    record = tmp_path / "record.jsonl"
    monkeypatch.setenv("FAKE_ATC_RECORD", str(record))
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), **GEARS)
    decoder_onnx(tmp_path / "04_export_onnx" / "decoder_static.onnx", cache_dim="cache_len")
    with pytest.raises(StageError) as err:
        atc.run(ctx)
    assert str(err.value) == ("convert_om.decoder=true: decoder_static.onnx's input attention_mask "
                              "(batch,cache_len) has symbolic dim 'cache_len'; only 'batch' "
                              "(convert_om.decode_batch=1) and 'chunk' (convert_om.decode_chunk=1) are fixed "
                              "at compile time")
    assert not record.exists()  # not even the prefill was compiled


def test_a_file_that_is_not_onnx_is_one_line(tmp_path, python_on_path):
    ctx = make_ctx(tmp_path, atc_path=str(FAKE_ATC), **GEARS)
    (tmp_path / "04_export_onnx" / "model.onnx").write_bytes(b"not really onnx")
    with pytest.raises(StageError, match=r"^export_onnx's model.onnx is not a readable ONNX model \(") as err:
        atc.run(ctx)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("mode, words", [
    ("fail-e10001", "E10001: Value [Ascend910B] for parameter [--soc_version] is invalid."),
    ("fail-ez3003", "EZ3003: No supported Ops kernel and engine are found for [MatMulV2], optype [MatMulV2]"),
])
def test_run_atc_error_becomes_stage_error(tmp_path, monkeypatch, python_on_path, mode, words):
    monkeypatch.setenv("FAKE_ATC_MODE", mode)
    with pytest.raises(StageError) as err:
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), **GEARS))
    message = str(err.value)
    assert message.startswith(f"ATC failed (exit 1): {words}")
    assert message.endswith("model.atc.log)")
    assert "Solution:" in message and "TraceBack" not in message and "\n" not in message


def test_run_no_om_is_an_error(tmp_path, monkeypatch, python_on_path):
    monkeypatch.setenv("FAKE_ATC_MODE", "no-om")
    with pytest.raises(StageError, match="ATC reported success but wrote no model.om"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), **GEARS))


def test_run_timeout_kills_atc(tmp_path, monkeypatch, python_on_path):
    monkeypatch.setenv("FAKE_ATC_MODE", "hang")
    with pytest.raises(StageError, match=r"convert_om.timeout_s=1 exceeded: ATC was killed"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), timeout_s=1, **GEARS))


def test_run_bad_dynamic_dims_is_a_stage_error(tmp_path, python_on_path, monkeypatch):
    with pytest.raises(config.ConfigError, match="convert_om.dynamic_dims"):  # refused when the config loads
        make_cfg(tmp_path, input_shape="input_ids:1,128", dynamic_dims="1;2")
    monkeypatch.setattr("llmpipe.config_checks.check_atc", lambda cfg: None)  # as a fields-only config
    with pytest.raises(StageError, match="convert_om.dynamic_dims"):
        atc.run(make_ctx(tmp_path, atc_path=str(FAKE_ATC), input_shape="input_ids:1,128", dynamic_dims="1;2"))


def test_suffixed_om_is_renamed(tmp_path):
    """Some ATC versions write <output>_<os>_<arch>.om; the stage's output is always model.om."""
    suffixed = tmp_path / "model_linux_x86_64.om"
    suffixed.write_bytes(b"om")
    assert atc._om_file(tmp_path / "model") == suffixed


# --------------------------------------------------------------------------- through run_stage


def _publish_export_onnx(cfg: config.RunConfig) -> None:
    """A finished export_onnx stage folder, with both graphs, whose fingerprint matches `cfg`."""
    folder = stages.stage_dir(cfg.run_dir(), "export_onnx")
    outputs = export_folder(folder)
    (folder / "parity.json").write_text("{}")
    Manifest(stage="export_onnx", status="completed", fingerprint=stages.fingerprints(cfg)["export_onnx"],
             outputs={**outputs, "parity": file_entry(folder, "parity.json")}).write(folder)


def test_run_stage_records_skip_then_reruns_when_atc_appears(tmp_path, monkeypatch, no_path_atc):
    cfg = make_cfg(tmp_path, **GEARS)
    _publish_export_onnx(cfg)
    manifest, executed = stages.run_stage("convert_om", cfg)
    assert executed and manifest.status == "skipped" and "not found" in manifest.reason
    assert manifest.metrics == {"graphs": {"model": "skipped", "decoder": "skipped"}}
    assert stages.run_stage("convert_om", cfg)[1] is False  # same machine: up to date

    monkeypatch.setenv("PATH", os.pathsep.join([str(FAKES), str(Path(sys.executable).parent)]))
    manifest, executed = stages.run_stage("convert_om", cfg)  # ATC appeared: fingerprint changed
    assert executed and manifest.status == "completed"
    assert set(manifest.outputs) == {"om", "log", "argv", "decoder_om", "decoder_log", "decoder_argv"}
    folder = stages.stage_dir(cfg.run_dir(), "convert_om")
    assert manifest.verify(folder) is None
    assert (folder / "model.om").is_file() and (folder / "decoder.om").is_file()


def test_fake_atc_is_executable():
    assert os.access(FAKE_ATC, os.X_OK)
    out = subprocess.run([sys.executable, str(FAKE_ATC), "--nope"], capture_output=True, text=True)
    assert out.returncode == 1 and "E10001" in out.stdout
