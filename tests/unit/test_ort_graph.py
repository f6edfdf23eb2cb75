"""export.ort_graph: export_onnx writes ort/, onnxruntime-genai's builder graph of consolidate's hf/ folder
(fused attention over the filled cache), checks that FusedEngine decodes it as PyTorch does, and `generate`
runs it for fp32; the portable graphs stay as they were. One debug-flavor run, built once."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from safetensors.torch import save_file

from llmpipe.config import from_dict
from llmpipe.data.tokenizer import train_tokenizer
from llmpipe.export import fused
from llmpipe.export import onnx as export
from llmpipe.infer.decode import CapacityError, greedy_reference
from llmpipe.infer.fused import FusedEngine, GraphConfig
from llmpipe.infer.ort import create_session
from llmpipe.manifest import Manifest
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import io as model_io
from llmpipe.stages import StageContext, StageError, _expand_outputs, stage_dir
from llmpipe.tools.generate import run_generate

pytestmark = pytest.mark.skipif(fused.unavailable_reason() is not None, reason=str(fused.unavailable_reason()))

ARGS = FLAVORS["debug"]


def _config(tmp_path: Path, **export_section):
    return from_dict({"run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts")},
                      "data": {"inputs": ["x"]}, "export": {"kv_cache": False, "kv_cache_len": 64, **export_section}})


def _consolidated(run: Path, hf: bool) -> tuple[Path, Manifest, Transformer]:
    """consolidate's folder as the stage writes it: weights, model config, tokenizer, and hf/ when `hf`."""
    folder = stage_dir(run, "consolidate")
    folder.mkdir(parents=True)
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    model.eval()
    tokenizer = train_tokenizer(["def main(x):\n    return x + 1\n" * 20], vocab_size=ARGS.vocab_size)
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if "freqs" not in k},
              str(folder / model_io.WEIGHTS))
    model_io.write_args(folder, ARGS, "fp32")
    tokenizer.save(str(folder / model_io.TOKENIZER))
    outputs = {"model": model_io.WEIGHTS, "model_config": model_io.CONFIG, "tokenizer": model_io.TOKENIZER}
    if hf:
        fused.write_hf_folder(model, folder / "hf", tokenizer)
        outputs["hf"] = "hf"
    manifest = Manifest("consolidate", "completed", "f", _expand_outputs(folder, outputs))
    manifest.write(folder)
    return folder, manifest, model


def _export(run: Path, cfg, consolidated) -> StageContext:
    work = stage_dir(run, "export_onnx")
    work.mkdir(parents=True)
    return StageContext(cfg, "export_onnx", run, work, {"consolidate": consolidated[:2]}, "fp")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(run folder, model, parity report): export_onnx run with export.ort_graph on a debug model."""
    tmp = tmp_path_factory.mktemp("ortgraph")
    run = tmp / "run"
    consolidated = _consolidated(run, hf=True)
    ctx = _export(run, _config(tmp, ort_graph=True), consolidated)
    result = export.run(ctx)
    Manifest("export_onnx", "completed", "fp", _expand_outputs(ctx.work_dir, result.outputs),
             metrics=result.metrics).write(ctx.work_dir)
    return run, consolidated[2], json.loads((ctx.work_dir / export.PARITY_FILE).read_text())


def test_the_ort_graph_decodes_greedily_as_pytorch_does_with_logits_within_1e_4(built):
    _, _, report = built
    ort = report["ort_graph"]
    assert ort["identical_tokens"], ort
    assert [r["batch"] for r in ort["runs"]] == [1, 2]
    assert ort["max_abs_diff"] <= 1e-4
    assert ort["top1_agreement"] == 1.0


def test_the_ort_graph_is_fused_and_the_portable_graphs_are_not(built):
    run, _, _ = built
    folder = stage_dir(run, "export_onnx")
    ops = {n.op_type for n in onnx.load(str(folder / "ort" / "model.onnx"), load_external_data=False).graph.node}
    assert {"GroupQueryAttention", "SkipSimplifiedLayerNormalization"} <= ops
    for portable in ("model.onnx", "decoder_static.onnx"):
        graph = onnx.load(str(folder / portable), load_external_data=False)
        assert all(op.domain in ("", "ai.onnx") for op in graph.opset_import), portable
        assert not {"GroupQueryAttention", "SimplifiedLayerNormalization"} & {n.op_type for n in graph.graph.node}


def test_generate_fp32_runs_the_ort_graph_and_writes_what_torch_writes(built):
    run, _, _ = built
    stats, shown = {}, {}
    for variant in ("torch", "fp32"):
        out = io.StringIO()
        stats[variant] = run_generate(run, "def main", 12, variant=variant, threads=1, out=out)
        shown[variant] = out.getvalue()
    assert "[onnxruntime fp32, ORT-optimised graph (export_onnx's ort/), KV cache of 64] prompt" in shown["fp32"]
    assert stats["fp32"]["tokens"] == stats["torch"]["tokens"]
    assert stats["fp32"]["text"] == stats["torch"]["text"]


def test_the_engine_continues_a_batch_like_pytorch_and_refuses_a_prompt_that_fills_its_cache(built):
    run, model, _ = built
    folder = stage_dir(run, "export_onnx") / "ort"
    cpu = export.device.ort_providers(["cpu"])[0]
    engine = FusedEngine(create_session(folder / "model.onnx", cpu, 1), GraphConfig.read(folder), 16)
    ids = np.random.default_rng(3).integers(0, ARGS.vocab_size, (3, 5))
    ref, _ = greedy_reference(model, ids, 11)
    logits = engine.start(ids)
    tokens = [logits.argmax(-1)]
    for _ in range(10):
        tokens.append(engine.step(tokens[-1]).argmax(-1))
    assert (np.stack(tokens, axis=1) == ref).all()
    engine.step(tokens[-1])  # the 16th slot
    with pytest.raises(CapacityError, match="^the engine's cache of 16 slots is full$"):
        engine.step(tokens[-1])
    with pytest.raises(CapacityError, match="^prompt of 16 tokens does not fit the engine's cache of 16$"):
        engine.start(np.zeros((1, 16), np.int64))


def test_ort_graph_without_an_hf_folder_is_one_line_naming_the_field_before_any_export(tmp_path):
    run = tmp_path / "run"
    ctx = _export(run, _config(tmp_path, ort_graph=True), _consolidated(run, hf=False))
    with pytest.raises(StageError, match=r"^export\.ort_graph: consolidate wrote no hf/ folder "
                                         r"\(set consolidate\.hf_layout: true\)$"):
        export.run(ctx)
    assert list(ctx.work_dir.iterdir()) == []


def test_the_benchmark_stage_runs_fp32_on_the_cpu_through_the_ort_graph(built):
    from llmpipe.bench import deploy
    from llmpipe.infer.decode import TorchEngine, generate

    run, model, _ = built
    m = deploy.Models(ARGS, model, {}, {}, 64, 1, requested=["fp32"], ort_graph=stage_dir(run, "export_onnx") / "ort")
    engine = deploy._ort_engine(m, "fp32", export.device.ort_providers(["cpu"])[0])
    assert isinstance(engine, FusedEngine)
    ids = np.random.default_rng(5).integers(0, ARGS.vocab_size, (2, 7))
    assert (generate(engine, ids, 9).tokens == generate(TorchEngine(model), ids, 9).tokens).all()


def test_ort_graph_with_consolidate_writing_no_hf_folder_is_refused_when_the_config_loads(tmp_path):
    from llmpipe.config import ConfigError

    tree = {"run": {"name": "t", "artifacts_dir": str(tmp_path / "artifacts")}, "data": {"inputs": ["x"]},
            "consolidate": {"hf_layout": False}, "export": {"ort_graph": True}}
    with pytest.raises(ConfigError) as err:
        from_dict(tree)
    assert str(err.value) == ("config: export.ort_graph: the builder reads consolidate's hf/ folder "
                              "(set consolidate.hf_layout: true)")


def test_serve_opens_the_portable_graphs_whose_rows_it_batches_at_their_own_positions(built):
    from llmpipe.infer.decode import StaticEngine
    from llmpipe.tools.generate import open_run
    from llmpipe.tools.serve import _slots

    run, _, _ = built
    assert isinstance(open_run(run, "fp32", 1).engine, FusedEngine)
    loaded = open_run(run, "fp32", 1, ort_graph=False)
    assert isinstance(loaded.engine, StaticEngine)
    assert _slots(loaded, 4)[1] == "continuous batching over the static decoder's rows"
