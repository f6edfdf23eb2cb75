"""benchmark: latency statistics, ORT variants and their accuracy, the stage's report files."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from llmpipe import device
from llmpipe.bench import run as bench
from llmpipe.config import from_dict
from llmpipe.export.onnx import export_prefill
from llmpipe.infer.ort import Variant
from llmpipe.infer.stats import latency_stats, logit_agreement, speedup, throughput
from llmpipe.manifest import Manifest, file_entry
from llmpipe.models.llama import FLAVORS, Transformer
from llmpipe.models.llama import io as model_io
from llmpipe.stages import StageContext, StageError

SHAPES = [[1, 16], [2, 32]]


# ---- stats: pure functions on known numbers -------------------------------------------------

def test_latency_stats_on_known_list():
    s = latency_stats([i / 1000 for i in range(1, 101)])  # 1 .. 100 ms
    assert s["n"] == 100 and s["min"] == pytest.approx(1) and s["max"] == pytest.approx(100)
    assert s["p50"] == pytest.approx(50.5) and s["mean"] == pytest.approx(50.5)
    assert s["p90"] == pytest.approx(90.1) and s["p99"] == pytest.approx(99.01)
    assert s["std"] == pytest.approx(math.sqrt((100**2 - 1) / 12))  # population std of 1..n
    one = latency_stats([0.002])
    assert one["p50"] == one["p99"] == pytest.approx(2.0) and one["std"] == 0.0
    with pytest.raises(ValueError):
        latency_stats([])


def test_throughput_and_speedup():
    assert throughput(4, 128, 10.0) == pytest.approx({"sequences_per_s": 400.0, "tokens_per_s": 51200.0})
    assert speedup(30.0, 10.0) == pytest.approx(3.0)
    with pytest.raises(ValueError):
        throughput(1, 1, 0.0)


def test_logit_agreement():
    ref = np.array([[[0.0, 1.0, 0.0], [2.0, 0.0, 0.0]]])  # (1, 2, 3): argmax 1, 0
    out = np.array([[[0.0, 1.5, 0.0], [0.0, 3.0, 0.0]]])  # argmax 1, 1
    a = logit_agreement(ref, out)
    assert a == pytest.approx({"max_abs_diff": 3.0, "mean_abs_diff": 5.5 / 6, "top1_agreement": 0.5})
    with pytest.raises(ValueError, match="shapes differ"):
        logit_agreement(ref, out[:, :1])


def test_time_calls_counts_warmup_and_iters():
    calls = []
    times = bench.time_calls(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and len(times) == 5 and all(t >= 0 for t in times)


# ---- the stage on the debug model -----------------------------------------------------------

CACHE = 48  # slots of the test's static decoder
LLM = {"prompt_lens": [8, 16], "batches": [1, 2], "decode_prompt_len": 8, "new_tokens": 4, "repeats": 1,
       "sample_tokens": 6}
QUALITY = {"samples": 4, "seq_len": 16, "continuation_prompts": 2, "continuation_tokens": 4}


def _inputs(root: Path) -> dict[str, tuple[Path, Manifest]]:
    """Published-looking prepare_data (tokenizer, validation shard) / train (one "full" checkpoint of
    the model) / consolidate / export_onnx (prefill + static decoder) / convert_om (skipped) under root."""
    from llmpipe.checkpoint import io as ckpt
    from llmpipe.data.shards import write_shard
    from llmpipe.data.tokenizer import train_tokenizer
    from llmpipe.export.onnx import export_static_decoder

    consolidated, exported, data, train = root / "consolidated", root / "exported", root / "data", root / "train"
    for folder in (consolidated, exported, data, train):
        folder.mkdir(parents=True)
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    save_file(model.state_dict(), str(consolidated / model_io.WEIGHTS))
    model_io.write_args(consolidated, model.args, "fp32")
    model_io.write_args(train, model.args, "fp32")
    text = ["def main(argv):\n    return len(argv) + 1\n" * 5, "import os\nprint(os.getcwd())\n" * 5]
    train_tokenizer(text, vocab_size=300).save(str(consolidated / model_io.TOKENIZER))
    rng = np.random.default_rng(0)
    write_shard(data / "val.bin", [rng.integers(1, 300, 40) for _ in range(4)], np.uint16)

    def write(folder: Path) -> list[Path]:
        save_file(model.state_dict(), str(folder / ckpt.MODEL))
        torch.save({}, folder / ckpt.OPTIM)
        torch.save({"step": 1}, folder / ckpt.TRAINER)
        return [folder / ckpt.MODEL, folder / ckpt.OPTIM, folder / ckpt.TRAINER]

    ckpt.save(train / "checkpoints", 1, write, {"format": "full", "model": model.args.to_dict()})
    export_prefill(model, exported / "model.onnx", opset=17)
    export_static_decoder(model, exported / "decoder_static.onnx", opset=17, length=CACHE)
    made = lambda stage, folder, metrics=None, **outputs: Manifest(
        stage=stage, status="completed", fingerprint=stage, metrics=metrics or {},
        outputs={k: file_entry(folder, v) for k, v in outputs.items()})
    skipped = Manifest(stage="convert_om", status="skipped", fingerprint="c", reason="CANN toolkit not found")
    return {"consolidate": (consolidated, made("consolidate", consolidated, model=model_io.WEIGHTS)),
            "export_onnx": (exported, made("export_onnx", exported, {"static_decoder_cache_len": CACHE},
                                           model="model.onnx", decoder_static="decoder_static.onnx")),
            "convert_om": (root / "om", skipped),
            "prepare_data": (data, made("prepare_data", data, val_bin="val.bin")),
            "train": (train, made("train", train, model_config=model_io.CONFIG))}


def _ctx(root: Path, inputs, convert_om: dict | None = None, **benchmark) -> StageContext:
    benchmark = {"shapes": SHAPES, "warmup": 1, "iters": 3, "threads": 2, "llm": LLM,
                 "quality": {**QUALITY, "enforce": False}, **benchmark}
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(root / "artifacts")},
                     "data": {"inputs": ["x"]}, "benchmark": benchmark, "convert_om": convert_om or {}})
    work = root / f"work-{len(list(root.glob('work-*')))}"
    work.mkdir()
    return StageContext(cfg, "benchmark", cfg.run_dir(), work, inputs, "fp")


@pytest.fixture(scope="module")
def stage(tmp_path_factory):
    """Run the benchmark stage once; tests read its result and files."""
    root = tmp_path_factory.mktemp("bench")
    inputs = _inputs(root)
    ctx = _ctx(root, inputs)
    result = bench.run(ctx)
    return ctx, result, json.loads((ctx.work_dir / "results.json").read_text()), inputs


def _row(results, variant, shape=(1, 16), provider="cpu"):
    [row] = [r for r in results["rows"] if (r["batch"], r["seq"], r["provider"], r["variant"])
             == (*shape, provider, variant)]
    return row


def test_stage_outputs_and_rows(stage):
    ctx, result, results, _ = stage
    assert {"results", "table", "plot", "variants"} <= set(result.outputs)
    for rel in result.outputs.values():
        assert (ctx.work_dir / rel).exists()
    assert (ctx.work_dir / "variants/fp16/model.onnx").is_file()
    assert (ctx.work_dir / "variants/int8/model.onnx").is_file()
    # 2 shapes x (torch + fp32 + fp16 + int8) on the cpu provider
    assert len(results["rows"]) == 8 and not any(r["error"] for r in results["rows"])
    for r in results["rows"]:
        assert r["latency_ms"]["n"] == 3 and r["latency_ms"]["p50"] > 0
        assert r["tokens_per_s"] == pytest.approx(r["sequences_per_s"] * r["seq"])
        assert r["speedup_vs_torch"] > 0
    assert _row(results, "torch")["speedup_vs_torch"] == pytest.approx(1.0)
    assert result.metrics["shape"] == "1x16" and "cpu/fp16" in result.metrics["p50_ms"]
    assert result.metrics["errors"] == 0


def test_accuracy_against_fp32(stage):
    _, result, results, _ = stage
    for shape in SHAPES:
        fp32 = _row(results, "fp32", shape)["accuracy"]
        assert fp32 == {"max_abs_diff": 0.0, "mean_abs_diff": 0.0, "top1_agreement": 1.0}
        fp16 = _row(results, "fp16", shape)["accuracy"]
        assert 0 < fp16["max_abs_diff"] < 0.05 and fp16["top1_agreement"] >= 0.9
        int8 = _row(results, "int8", shape)["accuracy"]
        assert int8["max_abs_diff"] > 0 and 0 <= int8["top1_agreement"] <= 1
        assert _row(results, "torch", shape)["accuracy"]["max_abs_diff"] < 1e-4  # ORT fp32 vs PyTorch
    assert result.metrics["top1_agreement"]["cpu/fp16"] >= 0.9


def test_notes_and_om_status(stage):
    ctx, _, results, _ = stage
    assert any("FP16 MatMul" in n for n in results["notes"])
    assert results["om"] == "om: not measured, convert_om was skipped (CANN toolkit not found)"
    assert results["notes"][-1] == results["om"]
    assert results["om"] in (ctx.work_dir / "results.md").read_text()
    assert bench.load_results(ctx.work_dir) == results
    assert results["threads"] == 2 and results["variants"]["fp16"]["file"] == "variants/fp16/model.onnx"


@pytest.fixture
def fresh_ais_bench(monkeypatch):
    """No cached ais_bench module during the test (an earlier test may have imported the fake); the
    ones the test imports are dropped after it, and monkeypatch puts the earlier ones back."""
    cached = lambda: {m for m in sys.modules if m == "ais_bench" or m.startswith("ais_bench.")}
    before = cached()
    for name in before:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in cached() - before:
        sys.modules.pop(name, None)


def test_om_status_without_ais_bench(stage, monkeypatch, fresh_ais_bench):
    ctx, _, _, inputs = stage
    om = ctx.work_dir.parent / "om-done"
    om.mkdir(exist_ok=True)
    for name in ("model.om", "decoder.om"):
        (om / name).write_bytes(b"x")
    done = Manifest(stage="convert_om", status="completed", fingerprint="c",
                    outputs={"om": file_entry(om, "model.om"), "decoder_om": file_entry(om, "decoder.om")})
    monkeypatch.setitem(sys.modules, "ais_bench", None)  # not importable, whatever the machine has
    ctx = _ctx(ctx.work_dir.parent, {**inputs, "convert_om": (om, done)})
    models, why = bench.om_models(ctx)
    assert models is None and why.startswith("ais_bench not installed")


def test_markdown_table_has_the_rows(stage):
    ctx, _, results, _ = stage
    text = (ctx.work_dir / "results.md").read_text()
    assert "| shape | provider | variant | p50 ms | p90 ms | p99 ms | tokens/s | speedup vs torch |" in text
    for b, s in SHAPES:
        for variant in ("torch", "fp32", "fp16", "int8"):
            assert f"| {b}x{s} | cpu | {variant} | " in text
    table = bench.markdown_table(results, with_notes=False)
    assert len(table.strip().splitlines()) == 2 + 8
    rows = bench.table_rows(results)
    assert len(rows) == 8
    assert set(rows[0]) >= {"shape", "variant", "p50_ms", "speedup_vs_torch", "top1_agreement"}


def test_plot_is_png(stage):
    ctx, result, _, _ = stage
    data = (ctx.work_dir / result.outputs["plot"]).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_unloadable_variant_is_recorded_not_fatal(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not an onnx model")
    cpu = device.ort_providers(["cpu"])[0]
    plan = bench.Plan({(1, 4): np.zeros((1, 4), dtype=np.int64)}, warmup=0, iters=1, threads=1)
    [unloadable] = bench.measure_variant(Variant("fp16", bad), cpu, plan, refs={})
    assert unloadable["latency_ms"] is None and unloadable["error"].startswith("cannot load:")
    [unconverted] = bench.measure_variant(Variant("int8", None, error="boom"), cpu, plan, refs={})
    assert unconverted["error"] == "conversion failed: boom"
    table = bench.markdown_table({"rows": [unloadable, unconverted], "shapes": [[1, 4]]})
    assert "| 1x4 | cpu | fp16 | cannot load: " in table
    assert "| 1x4 | cpu | int8 | conversion failed: boom |" in table


def test_user_errors(stage):
    ctx, _, _, inputs = stage
    root = ctx.work_dir.parent
    with pytest.raises(StageError, match="benchmark.providers: unknown provider 'tpu'"):
        bench.run(_ctx(root, inputs, providers=["tpu"]))
    with pytest.raises(StageError, match=r"benchmark\.shapes: seq 4096"):
        bench.run(_ctx(root, inputs, shapes=[[1, 4096]]))


def test_variants_of_a_model_with_external_data(tmp_path, monkeypatch):
    # The path a >1.8 GB model takes, forced on the debug model by a zero threshold.
    from llmpipe.infer import ort as bench_ort

    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    export_prefill(model, tmp_path / "model.onnx", opset=17, external_data_bytes=0)
    monkeypatch.setattr(bench_ort, "EXTERNAL_DATA_BYTES", 0)
    made = bench_ort.make_variants(tmp_path / "model.onnx", ["fp16", "int8"], tmp_path / "variants")
    cpu = device.ort_providers(["cpu"])[0]
    ids = np.ones((2, 8), dtype=np.int64)
    for name in ("fp16", "int8"):
        assert made[name].error is None
        assert (tmp_path / "variants" / name / "model.onnx.data").is_file()
        session = bench_ort.create_session(made[name].path, cpu, threads=1)
        assert bench_ort.run_logits(session, ids).shape == (2, 8, model.args.vocab_size)


# ---- what the stage refuses: external data outside the folder, nothing measured ------------

def _point_external(path: Path, location: str) -> None:
    """Point every external initializer of the ONNX file at `location` (the hostile edit)."""
    import onnx

    proto = onnx.load(str(path), load_external_data=False)
    for t in proto.graph.initializer:
        for entry in t.external_data:
            if entry.key == "location":
                entry.value = location
    onnx.save_model(proto, str(path))


def _external(path: Path, location: str) -> None:
    """Move model.onnx's tensors into model.onnx.data, then point them at `location`."""
    import onnx

    onnx.save_model(onnx.load(str(path)), str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=0, convert_attribute=True)
    _point_external(path, location)


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    from llmpipe.export.onnx import check_external_data

    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    folder = tmp_path / "export"
    folder.mkdir()
    export_prefill(model, folder / "model.onnx", opset=17, external_data_bytes=0)
    check_external_data(folder / "model.onnx")  # its own model.onnx.data: fine
    (folder / "escape.data").symlink_to("/etc/passwd")
    graph = (folder / "model.onnx").read_bytes()
    for location in ("../../../../etc/passwd", "/etc/passwd", "escape.data"):
        (folder / "model.onnx").write_bytes(graph)
        _point_external(folder / "model.onnx", location)
        with pytest.raises(StageError, match=rf"model\.onnx: initializer '.*' has its external data at "
                                             rf"'{location}', outside {folder}; refusing to read it"):
            check_external_data(folder / "model.onnx")


def test_benchmark_refuses_a_model_whose_external_data_points_outside(tmp_path):
    inputs = _inputs(tmp_path)
    _external(tmp_path / "exported" / "model.onnx", "../../../../etc/passwd")
    ctx = _ctx(tmp_path, inputs)
    with pytest.raises(StageError, match=r"external data at '\.\./\.\./\.\./\.\./etc/passwd', outside"):
        bench.run(ctx)
    assert not (ctx.work_dir / "variants").exists() and not (ctx.work_dir / "results.json").exists()


def test_benchmark_fails_when_the_fp32_reference_fails(tmp_path):
    import onnx

    inputs = _inputs(tmp_path)
    path = tmp_path / "exported" / "model.onnx"
    proto = onnx.load(str(path))
    proto.graph.node[-1].op_type = "NoSuchOp"  # a valid file that onnxruntime cannot run
    onnx.save_model(proto, str(path))
    ctx = _ctx(tmp_path, inputs, variants=["fp32"], torch_baseline=False, shapes=[[1, 16]])
    with pytest.raises(StageError, match=r"^benchmark: the fp32 reference failed on cpu at 1x16: cannot load: "):
        bench.run(ctx)
    assert not (ctx.work_dir / "results.json").exists()


def test_benchmark_fails_when_no_variant_produced_numbers(tmp_path, monkeypatch):
    from llmpipe.infer import ort as bench_ort

    def broken(src, dst):
        raise RuntimeError("converter broke\nsecond line")

    monkeypatch.setattr(bench_ort, "convert_fp16", broken)
    monkeypatch.setattr(bench_ort, "quantize_int8", broken)
    ctx = _ctx(tmp_path, _inputs(tmp_path), variants=["fp16", "int8"], shapes=[[1, 16]])  # torch rows still measured
    with pytest.raises(StageError) as err:
        bench.run(ctx)
    assert str(err.value) == ("benchmark: no ONNX variant produced numbers (benchmark.variants: fp16, int8; "
                              "first error: fp16: conversion failed: RuntimeError: converter broke)")


def test_a_provider_that_cannot_be_enabled_is_left_out_only_under_auto():
    ok = bench._row((1, 4), "cpu", "fp32", [0.001])
    gone = {**bench._row((1, 4), "cuda", "fp32", error="provider unavailable: did not enable"),
            "provider_unavailable": True}
    bench.check_measured({"rows": [ok, gone]}, ["fp32"], auto_providers=True)
    with pytest.raises(StageError, match="fp32 reference failed on cuda at 1x4: provider unavailable"):
        bench.check_measured({"rows": [ok, gone]}, ["fp32"], auto_providers=False)
    with pytest.raises(StageError, match="no ONNX variant produced numbers"):
        bench.check_measured({"rows": [gone]}, ["fp32"], auto_providers=True)


# ---- generation and quality (the deployment half) -------------------------------------------


def test_generation_rows_for_every_engine_with_ratios_to_torch(stage):
    ctx, result, results, _ = stage
    llm = results["llm"]
    assert llm["cache_len"] == CACHE and any("TPOT" in d for d in llm["definitions"])
    measured = [r for r in llm["decode"] if not r.get("error")]
    assert {(r["variant"], r["batch"]) for r in measured} == {(v, b) for v in ("torch", "fp32", "fp16", "int8")
                                                              for b in (1, 2)}
    for r in measured:
        assert r["tpot_ms"] > 0 and r["new_tokens"] == 4 and r["prompt_len"] == 8
        assert r["decode_tokens_per_s"] == pytest.approx(r["batch"] * 1e3 / r["tpot_ms"])
        assert r["e2e_tokens_per_s"] > 0 and r["decode_speedup"] > 0
    assert all(r["decode_speedup"] == 1.0 for r in measured if r["variant"] == "torch")
    prefill = [r for r in llm["prefill"] if not r.get("error")]
    assert sorted((r["variant"], r["prompt_len"]) for r in prefill if r["variant"] == "fp32") == [("fp32", 8),
                                                                                                   ("fp32", 16)]
    assert all(r["ttft_ms"] >= r["prefill_ms"] > 0 for r in prefill)
    [om] = [r for r in llm["decode"] if r["variant"] == "om"]
    assert om["error"] == "not measured: convert_om was skipped (CANN toolkit not found)"
    # greedy samples: ONNX fp32 with the static decoder picks PyTorch's tokens
    samples = llm["samples"]
    assert set(samples) == {"cpu/torch", "cpu/fp32", "cpu/fp16", "cpu/int8"}
    assert samples["cpu/fp32"]["tokens"] == samples["cpu/torch"]["tokens"] and len(samples["cpu/fp32"]["tokens"]) == 6
    assert result.metrics["decode_batch"] == 1 and result.metrics["ttft_prompt_len"] == 16
    assert set(result.metrics["tpot_ms"]) == {"cpu/torch", "cpu/fp32", "cpu/fp16", "cpu/int8"}
    for name in ("ttft_plot", "tpot_plot"):
        assert (ctx.work_dir / result.outputs[name]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (ctx.work_dir / "results.md").read_text()
    assert "## Generation" in text and "| cpu | int8 | 2 |" in text and "Definitions:" in text


def test_quality_on_validation_text_along_the_chain(stage):
    _, result, results, _ = stage
    q = results["quality"]
    assert q["samples"] == 4 and q["seq_len"] == 16 and set(q["variants"]) == {"fp32", "fp16", "int8"}
    fp32, fp16 = q["variants"]["fp32"], q["variants"]["fp16"]
    assert abs(fp32["ppl_increase"]) < 1e-5 and fp32["kl"] < 1e-8 and fp32["top1"] == 1.0
    assert fp32["continuation"]["token_agreement"] == 1.0 and fp32["verdict"] == "accepted"
    assert 0 < fp16["kl"] < 1e-3
    names = [r["name"] for r in q["chain"]]
    assert names == ["training checkpoint", "consolidated weights (torch fp32)", "ONNX fp32", "ONNX fp16",
                     "ONNX int8", "OM"]
    ckpt_row, consolidated = q["chain"][0], q["chain"][1]
    assert consolidated["max_abs_diff"] == 0.0 and consolidated["prev_kl"] == 0.0  # same weights
    assert ckpt_row["ppl"] == pytest.approx(consolidated["ppl"])
    assert q["chain"][-1]["ppl"] is None and "convert_om was skipped" in q["chain"][-1]["reason"]
    assert "The largest step is" in q["chain_markdown"]
    assert result.metrics["ppl"]["fp32"] == fp32["ppl"] and result.metrics["rejected"] == q["rejected"]


def test_a_gate_beyond_reach_fails_the_stage_in_one_line_or_marks_the_variant_rejected(stage):
    ctx, _, results, inputs = stage
    int8 = results["quality"]["variants"]["int8"]
    assert int8["kl"] > 0.0  # the premise: int8 moves the distribution (its argmax may not move on this toy)
    gate = {**QUALITY, "int8": {"max_kl": 0.0}}
    failing = _ctx(ctx.work_dir.parent, inputs, quality={**gate, "enforce": True}, require=["int8"])
    with pytest.raises(StageError) as err:
        bench.run(failing)
    message = str(err.value)
    assert message.startswith("benchmark: required variant int8 (benchmark.require) failed; 1 of 3 failed their "
                              "quality gates: int8: KL "), message
    assert "benchmark.quality.int8.max_kl=0" in message and "\n" not in message
    assert "| int8 |" in (failing.work_dir / "results.md").read_text()  # the failed attempt keeps its numbers
    # not required: int8 is rejected with its numbers kept (results.md, the manifest's metrics), the stage passes
    ctx2 = _ctx(ctx.work_dir.parent, inputs, quality={**gate, "enforce": True})
    result = bench.run(ctx2)
    rejected = json.loads((ctx2.work_dir / "results.json").read_text())["quality"]
    assert rejected["rejected"] == ["int8"] and rejected["variants"]["int8"]["verdict"] == "rejected"
    assert result.metrics["rejected"] == ["int8"]
    assert result.metrics["top1"]["int8"] == rejected["variants"]["int8"]["top1"]
    assert result.metrics["verdicts"] == {"fp32": "accepted", "fp16": "accepted", "int8": "rejected"}
    assert result.metrics["rejected_because"]["int8"].startswith("benchmark: int8 fails its quality gate: ")
    table = (ctx2.work_dir / "results.md").read_text()
    assert "Rejected (kept here with their numbers" in table and "- benchmark: int8 fails its quality gate" in table


FAKES = Path(__file__).resolve().parents[1] / "fakes"


def _fake_om(path: Path, onnx_path: Path, input_shape: str, dynamic_dims: str | None) -> None:
    """An OM file as tests/fakes/atc writes it (the real ATC cannot exist here)."""
    path.write_text("LLMPIPE-FAKE-OM v1\n" + json.dumps({"onnx": str(onnx_path.resolve()), "input_shape": input_shape,
                                                          "dynamic_dims": dynamic_dims, "soc_version": "Ascend910B"})
                    + "\n")


def test_om_models_are_measured_through_ais_bench_where_it_exists(tmp_path, monkeypatch, fresh_ais_bench):
    """With a fake ais_bench (tests/fakes/ais_bench_pkg, running the ONNX the fake OM names in
    onnxruntime): the OM rows are measured, the static OM decoder only at its compiled batch, the
    prefill OM padded to its gears, and the OM hop of the chain is measured."""
    from llmpipe.infer.graphs import static_inputs

    monkeypatch.syspath_prepend(str(FAKES / "ais_bench_pkg"))
    inputs = _inputs(tmp_path)
    a = FLAVORS["debug"]
    om = tmp_path / "om"
    om.mkdir()
    exported = tmp_path / "exported"
    _fake_om(om / "model.om", exported / "model.onnx", "input_ids:1,-1", "8;16")
    dims = {"input_ids": "1,1", "position_ids": "1,1", "attention_mask": f"1,{CACHE}"}
    shape = ";".join(f"{n}:{dims.get(n, f'1,{a.n_kv_heads},{CACHE},{a.head_dim}')}" for n in static_inputs(a.n_layers))
    _fake_om(om / "decoder.om", exported / "decoder_static.onnx", shape, None)
    done = Manifest(stage="convert_om", status="completed", fingerprint="c",
                    outputs={"om": file_entry(om, "model.om"), "decoder_om": file_entry(om, "decoder.om")})
    ctx = _ctx(tmp_path, {**inputs, "convert_om": (om, done)}, variants=["fp32"], shapes=[[1, 16]],
               convert_om={"input_shape": "input_ids:1,-1", "dynamic_dims": "8;16"})
    bench.run(ctx)
    results = json.loads((ctx.work_dir / "results.json").read_text())
    assert results["om"] == "om: measured through ais_bench"
    rows = {(r["batch"], bool(r.get("error"))) for r in results["llm"]["decode"] if r["variant"] == "om"}
    assert rows == {(1, False), (2, True)}  # decoder.om is compiled for batch 1
    om_prefill = [r for r in results["llm"]["prefill"] if r["variant"] == "om"]
    assert [r["prompt_len"] for r in om_prefill] == [8, 16] and all(r["ttft_ms"] > 0 for r in om_prefill)
    q = results["quality"]
    assert q["variants"]["om"]["top1"] == 1.0 and q["variants"]["om"]["continuation"]["token_agreement"] == 1.0
    assert q["chain"][-1]["name"] == "OM" and q["chain"][-1]["ppl"] is not None
    assert results["llm"]["samples"]["npu/om"]["tokens"] == results["llm"]["samples"]["cpu/torch"]["tokens"]
