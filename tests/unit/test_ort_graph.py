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

from llmpipe.bench.quality import enforce_gates
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


def _engine(run: Path, cache_len: int) -> FusedEngine:
    """FusedEngine over the built run's export_onnx ort/ graph, one thread."""
    folder = stage_dir(run, "export_onnx") / "ort"
    cpu = export.device.ort_providers(["cpu"])[0]
    return FusedEngine(create_session(folder / "model.onnx", cpu, 1), GraphConfig.read(folder), cache_len)


def test_the_engine_continues_a_batch_like_pytorch_and_refuses_a_prompt_that_fills_its_cache(built):
    run, model, _ = built
    engine = _engine(run, 16)
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
    m = deploy.Models(ARGS, model, {}, {}, 64, 1, requested=["fp32"],
                      fused={"fp32": stage_dir(run, "export_onnx") / "ort"})
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


def test_serve_batches_the_ort_graphs_rows_and_keeps_the_portable_graphs_for_other_engines(built):
    from llmpipe.infer.batching import FusedSlots
    from llmpipe.infer.decode import StaticEngine
    from llmpipe.tools.generate import open_run
    from llmpipe.tools.serve import _slots

    run, _, _ = built
    loaded = open_run(run, "fp32", 1)
    assert isinstance(loaded.engine, FusedEngine)
    slots, how = _slots(loaded, 4)
    assert isinstance(slots, FusedSlots) and how == "continuous batching over the ORT-optimised graph's rows"
    loaded = open_run(run, "fp32", 1, ort_graph=False)
    assert isinstance(loaded.engine, StaticEngine)
    assert _slots(loaded, 4)[1] == "continuous batching over the static decoder's rows"


# ---- int4 / int8w through the builder's weight-only graphs (the benchmark stage, generate) ----------------


@pytest.fixture(scope="module")
def benched(built, tmp_path_factory):
    """The benchmark stage of the built run with fp32, int4 and int8w (gates not enforced), published as the
    pipeline publishes it: (run folder, results, stage context)."""
    from llmpipe.bench import run as bench
    from tests.unit.test_bench import LLM, QUALITY, _inputs

    run, _, _ = built
    root = tmp_path_factory.mktemp("ortbench")
    inputs = _inputs(root)  # prepare_data's validation shard, train's checkpoint of the same debug model
    for name in ("consolidate", "export_onnx"):
        folder = stage_dir(run, name)
        inputs[name] = (folder, Manifest.read(folder))
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(root / "artifacts")}, "data": {"inputs": ["x"]},
                     "export": {"ort_graph": True},
                     "benchmark": {"variants": ["fp32", "int4", "int8w"], "shapes": [[1, 16]], "warmup": 1, "iters": 2,
                                   "threads": 1, "llm": LLM, "torch_baseline": False,
                                   "quality": {**QUALITY, "enforce": False}}})
    work = stage_dir(run, "benchmark")
    work.mkdir()
    ctx = StageContext(cfg, "benchmark", run, work, inputs, "fp")
    result = bench.run(ctx)
    Manifest("benchmark", "completed", "fp", _expand_outputs(work, result.outputs), metrics=result.metrics).write(work)
    return run, json.loads((work / bench.RESULTS_FILE).read_text()), ctx


def _matmulnbits(path: Path, attribute: str) -> set[int]:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {a.i for n in graph.node if n.op_type == "MatMulNBits" for a in n.attribute if a.name == attribute}


def test_int4_and_int8w_get_the_builders_weight_only_graph_at_the_runs_settings(benched):
    run, _, _ = benched
    for name, bits in (("int4", 4), ("int8w", 8)):
        path = stage_dir(run, "benchmark") / "variants" / name / "ort" / "model.onnx"
        ops = {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}
        assert {"GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"} <= ops, name
        # int4 keeps the output head at 8 bits (benchmark.quantize.int4.head_bits, chosen on SmolLM2-135M)
        assert _matmulnbits(path, "bits") == ({4, 8} if name == "int4" else {bits}), name
        portable = stage_dir(run, "benchmark") / "variants" / name / "model.onnx"  # the portable one stays
        # both graphs in blocks of 32: int4's ort_block_size is null (= block_size) since the real model's
        # measurement (docs/measurements/quantisation.md)
        assert _matmulnbits(path, "block_size") == {32}, name
        assert _matmulnbits(portable, "block_size") == {32}, name


# Measured on the debug model (random weights, 4 x 16 validation tokens): the builder's int4 graph's logits
# are within 0.39 of torch fp32, int8w's within 0.04 (the portable graphs': 0.39 / 0.037); ~2.5x room.
TOLERANCE = {"int4": 1.0, "int8w": 0.1}


def test_the_gates_judge_the_ort_graph_each_variant_deploys_and_keep_the_portable_ones_beside(benched):
    run, results, _ = benched
    q = results["quality"]
    for name in ("fp32", "int4", "int8w"):
        r = q["variants"][name]
        assert r["graph"] == "ORT-optimised" and set(r["portable"]) >= {"ppl", "top1", "kl"}, name
        assert r["verdict"] in ("accepted", "rejected")
        assert r["max_abs_diff"] < TOLERANCE.get(name, 1e-4), (name, r["max_abs_diff"])
    assert q["variants"]["fp32"]["top1"] == 1.0 and q["variants"]["fp32"]["continuation"]["token_agreement"] == 1.0
    hops = {h["name"]: h for h in q["chain"]}
    assert hops["ORT graph int4"]["prev"] == "consolidated weights (torch fp32)"
    table = (stage_dir(run, "benchmark") / "results.md").read_text()
    assert "| int4 (ORT-optimised graph) |" in table and "| int4 (portable graphs) |" in table


def test_the_generation_rows_and_generate_run_int4_through_its_ort_graph(benched):
    run, results, _ = benched
    rows = [r for r in results["llm"]["decode"] if r["variant"] == "int4"]
    assert rows and all(r["decode_tokens_per_s"] for r in rows)
    out = io.StringIO()
    stats = run_generate(run, "def main", 8, variant="int4", threads=1, out=out, allow_ungated=True)  # as served
    assert "[onnxruntime int4, ORT-optimised graph (benchmark/variants/int4/ort/), KV cache of 64]" in out.getvalue()
    assert len(stats["tokens"]) == 8


def test_an_ort_graph_beyond_its_gate_fails_in_one_line_naming_that_graph(benched):
    from llmpipe.bench import deploy
    from tests.unit.test_bench import QUALITY

    run, results, ctx = benched
    top1 = results["quality"]["variants"]["int4"]["top1"]
    cfg = from_dict({"data": {"inputs": ["x"]}, "benchmark": {"variants": ["fp32", "int4"], "quality": {
        **QUALITY, "enforce": True, "int4": {"min_top1": 1.0}}}}).benchmark
    model = Transformer(ARGS)
    model.init_weights(seed=0)
    bench_dir = stage_dir(run, "benchmark")
    variants = {"fp32": deploy.Variant("fp32", stage_dir(run, "export_onnx") / "model.onnx"),
                "int4": deploy.Variant("int4", bench_dir / "variants" / "int4" / "model.onnx")}
    m = deploy.Models(ARGS, model.eval(), variants, {}, 64, 1, requested=["fp32", "int4"],
                      fused={"fp32": stage_dir(run, "export_onnx") / "ort",
                             "int4": bench_dir / "variants" / "int4" / "ort"})
    q = deploy.quality_results(m, ctx.input_path("prepare_data", "val_bin"), ctx.inputs["train"][0], cfg, 16,
                               ctx.cfg.run.seed)
    assert q["rejected"] == ["int4"]
    assert q["variants"]["int4"]["rejected_because"].startswith(
        f"benchmark: int4 (ORT-optimised graph) fails its quality gate: top-1 agreement {top1:.4f} < "
        "benchmark.quality.int4.min_top1=1 ")
    with pytest.raises(StageError, match=r": int4 \(ORT-optimised graph\): top-1 agreement "):
        enforce_gates(q["verdicts"], True, ["int4"])


@pytest.mark.parametrize(("quantize", "message"), [
    ({"int4": {"ort_block_size": 512}}, "benchmark.quantize.int4.ort_block_size=512: onnxruntime-genai's builder, "
                                        "which makes int4's ORT-optimised graph (export.ort_graph), takes 16, 32, 64, "
                                        "128, 256"),
    ({"int8w": {"block_size": 512}}, "benchmark.quantize.int8w.block_size=512: onnxruntime-genai's builder, "
                                     "which makes int8w's ORT-optimised graph (export.ort_graph), takes 16, 32, 64, "
                                     "128, 256"),
    ({"int8w": {"accuracy_level": 0}}, "benchmark.quantize.int8w.accuracy_level=0: onnxruntime-genai's builder, "
                                       "which makes int8w's ORT-optimised graph (export.ort_graph), takes 1 to 4"),
])
def test_a_setting_the_builder_cannot_apply_is_refused_when_the_config_loads(tmp_path, quantize, message):
    from llmpipe.config import ConfigError

    tree = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
            "export": {"ort_graph": True}, "benchmark": {"variants": ["fp32", "int4", "int8w"], "quantize": quantize}}
    with pytest.raises(ConfigError) as err:
        from_dict(tree)
    assert str(err.value) == f"config: {message}"
    from_dict({**tree, "export": {"ort_graph": False}})  # the portable graphs alone take it


def test_the_engine_sizes_its_cache_to_the_work_and_grows_past_it_as_pytorch_decodes(built):
    run, model, _ = built
    engine = _engine(run, 64)
    ids = np.random.default_rng(4).integers(0, ARGS.vocab_size, (2, 6))
    ref, _ = greedy_reference(model, ids, 20)
    engine.reserve(9)  # fewer slots than the 25 used: the buffers double twice (9 -> 18 -> 36)
    tokens = [engine.start(ids).argmax(-1)]
    assert engine._now.buffers[0].shape[2] == 9
    for _ in range(19):
        tokens.append(engine.step(tokens[-1]).argmax(-1))
    assert engine._now.buffers[0].shape[2] == 36
    assert (np.stack(tokens, axis=1) == ref).all()


def test_evaluate_scores_fp32_and_int4_through_their_ort_graphs_as_it_scores_pytorch(benched, tmp_path):
    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.eval.stage import engine_lm
    from tests.unit.test_eval_lm import PAIRS, _requests

    run, _, bctx = benched
    inputs = {n: (stage_dir(run, n), Manifest.read(stage_dir(run, n))) for n in ("consolidate", "export_onnx",
                                                                                 "benchmark")}
    ctx = StageContext(bctx.cfg, "evaluate", run, tmp_path, inputs, "fp")
    tokenizer = load_tokenizer(stage_dir(run, "consolidate") / model_io.TOKENIZER)
    lms = {n: engine_lm(ctx, n, ARGS, tokenizer, 0, 0, [], bctx.cfg.evaluate, 1) for n in ("torch", "fp32", "int4")}
    assert isinstance(lms["fp32"].engine, FusedEngine) and isinstance(lms["int4"].engine, FusedEngine)
    scores = {n: np.array([x for x, _ in lm.loglikelihood(_requests("loglikelihood", PAIRS))]) for n, lm in lms.items()}
    assert np.abs(scores["fp32"] - scores["torch"]).max() <= 1e-4
    assert 0 < np.abs(scores["int4"] - scores["torch"]).max() < 5.0  # int4 moves them, within reason
    gen = [("def main", {"until": ["\n\n"], "max_gen_toks": 10, "do_sample": False})]
    assert lms["fp32"].generate_until(_requests("generate_until", gen)) == \
        lms["torch"].generate_until(_requests("generate_until", gen))


def test_continuous_batching_over_the_ort_graph_decodes_each_row_as_pytorch_does_alone(built):
    """Rows join one at a time and leave when done (the last row moving into the freed one), each at its own
    position in one right-padded step: every sequence's greedy tokens are PyTorch's for it alone."""
    from llmpipe.infer.batching import FusedSlots

    run, model, _ = built
    slots = FusedSlots(_engine(run, 64), 3)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(0, ARGS.vocab_size, n).tolist() for n in (5, 9, 3, 7, 4)]
    wanted = [10, 6, 12, 8, 9]  # tokens per sequence: they finish at different steps
    refs = [greedy_reference(model, np.array([p]), k)[0][0].tolist() for p, k in zip(prompts, wanted)]
    queue, rows, out = list(range(len(prompts))), [], {i: [] for i in range(len(prompts))}
    while queue or rows:
        if queue and slots.free():
            i = queue.pop(0)
            out[i].append(int(slots.admit([prompts[i]])[0].argmax()))
            rows.append(i)
        if rows:
            logits = slots.step(np.array([out[i][-1] for i in rows]))
            for i, row in zip(rows, logits):
                out[i].append(int(row.argmax()))
        for r in reversed(range(len(rows))):
            if len(out[rows[r]]) >= wanted[rows[r]]:
                moved = slots.release(r)
                assert moved == (len(rows) - 1 if r != len(rows) - 1 else None)
                rows[r] = rows[-1]
                rows.pop()
    assert [out[i][:k] for i, k in enumerate(wanted)] == refs
    assert slots.n == 0


def test_llmpipe_serve_answers_the_openai_client_through_the_ort_graph_as_generate_does(benched, tmp_path):
    """A real `llmpipe serve` process of the run (its int4 variant: the builder's int4 graph), driven by the
    openai client: greedy text equals `llmpipe generate`'s, and two prompts of different lengths decoded in one
    batch each get the text they get alone."""
    import openai

    from tests.integration.test_serve import Server, alone_and_together

    run, _, _ = benched
    server = Server(run, tmp_path / "server.log", "--variant", "int4", "--max-batch", "2", "--allow-ungated")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = client.models.list().data[0].id
        served = client.completions.create(model=model, prompt="def main", max_tokens=12, temperature=0)
        local = run_generate(run, "def main", 12, "int4", threads=1, out=io.StringIO(), allow_ungated=True)
        assert served.choices[0].text == local["text"]
        alone, together = alone_and_together(client, model, ["def main(x):\n    return", "x"], 16)
        assert together == alone
    finally:
        server.stop()
    assert "continuous batching over the ORT-optimised graph's rows" in (tmp_path / "server.log").read_text()


def test_the_builders_options_follow_the_runs_quantize_settings():
    from llmpipe.config import QuantizeSection

    q = QuantizeSection()
    assert fused.weight_only_options(q.int4) == ("int4", {"block_size": "32", "accuracy_level": "4",
                                                          "is_symmetric": "false",
                                                          "matmul_mixed_precision": "last_matmul:int8",
                                                          "shared_embeddings": "false"})
    assert fused.weight_only_options(q.int8w) == ("int8", {"block_size": "32", "accuracy_level": "4",
                                                           "is_symmetric": "false"})
    q = QuantizeSection.model_validate({"int4": {"bits": 2}, "int8w": {"symmetric": True, "ort_block_size": 64}})
    assert fused.weight_only_options(q.int4) is None  # 2 bits: the builder has no such precision, portable only
    assert fused.weight_only_options(q.int8w)[1] == {"block_size": "64", "accuracy_level": "4", "is_symmetric": "true"}


def test_ort_block_size_defines_the_result_but_a_run_made_before_it_keeps_its_fingerprints(tmp_path):
    """An added result field: at its default a config that never named it hashes as before (a finished benchmark
    is not re-run by the upgrade); set to another value, the benchmark stage's fingerprint moves."""
    from llmpipe.stages import fingerprints

    base = {"run": {"name": "t", "artifacts_dir": str(tmp_path)}, "data": {"inputs": ["x"]},
            "export": {"ort_graph": True}, "benchmark": {"variants": ["fp32", "int4"]}}
    before = fingerprints(from_dict(base))
    at_default = fingerprints(from_dict({**base, "benchmark": {**base["benchmark"],
                                                               "quantize": {"int4": {"ort_block_size": None}}}}))
    changed = fingerprints(from_dict({**base, "benchmark": {**base["benchmark"],
                                                            "quantize": {"int4": {"ort_block_size": 64}}}}))
    assert at_default == before
    assert changed["benchmark"] != before["benchmark"]
    assert changed["train"] == before["train"]
