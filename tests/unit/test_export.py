"""export_onnx: the prefill graph, dynamic axes, opset, parity against PyTorch, external data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import save_file

from llmpipe import stages
from llmpipe.config import from_dict
from llmpipe.export import onnx as export
from llmpipe.infer import graphs
from llmpipe.manifest import Manifest, file_entry
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import io as model_io
from llmpipe.stages import StageContext, StageError


def _config(tmp_path: Path, **export_section):
    return from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts")},
                      "data": {"inputs": ["x"]}, "export": export_section})


def _model_folder(folder: Path) -> Transformer:
    """A consolidated-model folder as the consolidate stage writes it (debug flavor, seed 0)."""
    folder.mkdir(parents=True, exist_ok=True)
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    save_file(model.state_dict(), str(folder / model_io.WEIGHTS))
    model_io.write_args(folder, model.args, "fp32")
    return model.eval()


def _ctx(tmp_path: Path, cfg) -> StageContext:
    folder = tmp_path / "consolidated"
    _model_folder(folder)
    manifest = Manifest(stage="consolidate", status="completed", fingerprint="f",
                        outputs={"model": file_entry(folder, model_io.WEIGHTS)})
    work = tmp_path / "work"
    work.mkdir()
    return StageContext(cfg, "export_onnx", cfg.run_dir(), work, {"consolidate": (folder, manifest)}, "fp")


def test_stage_exports_with_parity_on_dynamic_shapes(tmp_path):
    # Both shapes differ from the traced (2, 16): batch and seq axes must really be dynamic.
    cfg = _config(tmp_path, parity_shapes=[[1, 5], [3, 40]], parity_atol=1e-4)
    # Run through the real framework: a published consolidate stage, then run_stage.
    consolidated = stages.stage_dir(cfg.run_dir(), "consolidate")
    _model_folder(consolidated)
    (consolidated / model_io.TOKENIZER).write_text("{}")  # a completed consolidate lists all three
    Manifest(stage="consolidate", status="completed", fingerprint=stages.fingerprints(cfg)["consolidate"],
             outputs={"model": file_entry(consolidated, model_io.WEIGHTS),
                      "model_config": file_entry(consolidated, model_io.CONFIG),
                      "tokenizer": file_entry(consolidated, model_io.TOKENIZER)}).write(consolidated)

    manifest, executed = stages.run_stage("export_onnx", cfg)

    assert executed and manifest.status == "completed"
    assert set(manifest.outputs) == {"model", "parity", "decoder", "decoder_static"}
    folder = stages.stage_dir(cfg.run_dir(), "export_onnx")
    parity = json.loads((folder / "parity.json").read_text())
    assert [(s["batch"], s["seq"]) for s in parity["shapes"]] == [(1, 5), (3, 40)]
    assert parity["passed"] and parity["max_abs_diff"] <= 1e-4
    assert parity["top1_agreement"] == 1.0
    assert manifest.metrics["opset"] == 17 == export.file_opset(folder / "model.onnx")
    assert manifest.metrics["onnx_bytes"] == (folder / "model.onnx").stat().st_size
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    assert [(i.name, dims(i)) for i in graph.input] == [("input_ids", ["batch", "seq"])]
    assert [(o.name, dims(o)[:3]) for o in graph.output][:2] == [("logits", ["batch", "seq", 8192]),
                                                                 ("present.0.key", ["batch", 2, "seq"])]
    assert graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    static = parity["static_decoder"]
    assert static["identical_tokens"] and static["cache_len"] == 512  # debug flavor: max_seq_len 512
    assert [r["new_tokens"] for r in static["runs"]] == [64, 64]
    assert manifest.metrics["static_decoder_identical_tokens"] is True


def test_opset_in_file_follows_config(tmp_path):
    cfg = _config(tmp_path, opset=18, parity_shapes=[[2, 8]])
    ctx = _ctx(tmp_path, cfg)
    result = export.run(ctx)
    assert export.file_opset(ctx.work_dir / result.outputs["model"]) == 18 == result.metrics["opset"]


def test_parity_tolerance_too_low_raises(tmp_path):
    cfg = _config(tmp_path, parity_atol=1e-12, parity_shapes=[[1, 8]])
    ctx = _ctx(tmp_path, cfg)
    with pytest.raises(StageError, match=r"export\.parity_atol=1e-12"):
        export.run(ctx)
    report = json.loads((ctx.work_dir / "parity.json").read_text())  # kept for diagnosis
    assert not report["passed"] and report["max_abs_diff"] > 1e-12


def test_parity_shape_longer_than_model_raises(tmp_path):
    cfg = _config(tmp_path, parity_shapes=[[1, 8], [1, 513]])  # debug max_seq_len is 512
    with pytest.raises(StageError, match=r"export\.parity_shapes.*513.*max_seq_len 512"):
        export.run(_ctx(tmp_path, cfg))


def test_external_data_for_big_models(tmp_path):
    model = _model_folder(tmp_path / "m")
    path = tmp_path / "out" / "model.onnx"
    path.parent.mkdir()
    files = export.export_prefill(model, path, opset=17, external_data_bytes=0)  # every model is "big"
    assert files == [path, path.with_name("model.onnx.data")]
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.onnx", "model.onnx.data"]
    assert path.stat().st_size < 100_000 < files[1].stat().st_size  # weights live in the data file
    export.check_model(path)
    ids = export.random_ids(2, 24, model.args.vocab_size, seed=3)
    out = ort.InferenceSession(str(path)).run(["logits"], {"input_ids": ids})[0]
    with torch.inference_mode():
        ref = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(out, ref, atol=1e-4, rtol=0)


def test_export_refuses_non_fp32_model(tmp_path):
    model = Transformer(FLAVORS["debug"]).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32"):
        export.export_prefill(model, tmp_path / "model.onnx", opset=17)


def test_kv_cache_decoder_continues_a_sequence_like_the_full_pass(tmp_path):
    """decoder_with_past.onnx, fed PyTorch's cache of a prefix, matches PyTorch's full-sequence
    logits for the rest (dynamic batch, new-token count and past length; bottom-right causal mask)."""
    model = _model_folder(tmp_path / "m")
    path = tmp_path / "dec.onnx"
    export.export_decoder(model, path, opset=17)
    export.check_model(path)
    report = export.decoder_parity(model, path, [(1, 2), (3, 9), (2, 40)], seed=0)
    assert [(s["batch"], s["past"], s["new"]) for s in report["shapes"]] == [(1, 1, 1), (3, 4, 5), (2, 20, 20)]
    assert report["max_abs_diff"] <= 1e-4 and report["top1_agreement"] == 1.0
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    names = {i.name: dims(i) for i in graph.input}
    assert names["past.0.key"] == ["batch", model.args.n_kv_heads, "past_seq", model.args.head_dim]
    assert {o.name for o in graph.output} >= {"logits", "present.1.value"}


def test_static_decoder_greedy_64_tokens_match_pytorch_and_the_graph_is_static(tmp_path):
    """decoder_static.onnx with a 96-slot cache: greedy decoding (onnxruntime, prefill graph + static
    decoder, cache written in place) picks the same 64 tokens as PyTorch's cached greedy decoding, logits
    within 1e-4; the cache inputs have fixed shapes, only batch and chunk are symbolic; opset 17."""
    model = _model_folder(tmp_path / "m")
    export.export_prefill(model, tmp_path / "model.onnx", opset=17)
    path = tmp_path / "decoder_static.onnx"
    export.export_static_decoder(model, path, opset=17, length=96)
    export.check_model(path)
    report = export.static_parity(model, tmp_path / "model.onnx", path, 96, seed=3, new_tokens=64)
    assert report["identical_tokens"] and report["max_abs_diff"] <= 1e-4
    assert [(r["batch"], r["prompt"], r["new_tokens"]) for r in report["runs"]] == [(1, 16, 64), (2, 16, 64)]
    graph = onnx.load(str(path), load_external_data=False).graph
    dims = lambda v: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    a = model.args
    assert {i.name: dims(i) for i in graph.input} == {
        "input_ids": ["batch", "chunk"], "position_ids": ["batch", "chunk"], "attention_mask": ["batch", 96],
        **{f"cache.{i}.{p}": ["batch", a.n_kv_heads, 96, a.head_dim] for i in range(a.n_layers)
           for p in ("key", "value")}}
    assert dims(graph.output[1])[:3] == ["batch", a.n_kv_heads, "chunk"]  # (head_dim is left unnamed)
    assert export.file_opset(path) == 17


def test_static_decoder_chunks_match_the_full_pass(tmp_path):
    """Chunks of several tokens (a chunked prefill) over a partly filled cache, with rows at the same
    position: logits equal PyTorch's full-sequence logits for those positions."""
    model = _model_folder(tmp_path / "m")
    path = tmp_path / "decoder_static.onnx"
    export.export_static_decoder(model, path, opset=17, length=32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    a = model.args
    ids = export.random_ids(2, 20, a.vocab_size, seed=5)
    with torch.inference_mode():
        ref = model(torch.from_numpy(ids)).numpy()  # (2, 20, vocab)
    cache = {n: np.zeros((2, a.n_kv_heads, 32, a.head_dim), np.float32) for n in graphs.static_inputs(a.n_layers)[3:]}
    mask = np.zeros((2, 32), np.int64)
    pos = 0
    for chunk in (7, 1, 5, 7):
        feeds = {"input_ids": ids[:, pos:pos + chunk], "attention_mask": mask, **cache,
                 "position_ids": np.tile(np.arange(pos, pos + chunk), (2, 1))}
        logits, *new = session.run(None, feeds)
        np.testing.assert_allclose(logits, ref[:, pos:pos + chunk], atol=1e-4, rtol=0)
        for name, kv in zip(cache, new):
            cache[name][:, :, pos:pos + chunk] = kv
        mask[:, pos:pos + chunk] = 1
        pos += chunk


def test_kv_cache_len_beyond_the_model_is_refused():
    with pytest.raises(StageError, match=r"export.kv_cache_len=600 exceeds the model's max_seq_len 512"):
        graphs.cache_len(600, 512)
    assert graphs.cache_len(None, 4096) == 1024 and graphs.cache_len(None, 512) == 512
