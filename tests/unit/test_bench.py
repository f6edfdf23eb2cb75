"""benchmark: latency statistics, ORT variants and their accuracy, the stage's report files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import save_file

from llmpipe import device
from llmpipe.bench import run as bench
from llmpipe.bench.ort import Variant
from llmpipe.bench.stats import latency_stats, logit_agreement, speedup, throughput
from llmpipe.config import from_dict
from llmpipe.export.onnx import export_prefill
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

def _inputs(root: Path) -> dict[str, tuple[Path, Manifest]]:
    """Published-looking consolidate / export_onnx / convert_om (skipped) results under root."""
    consolidated, exported = root / "consolidated", root / "exported"
    consolidated.mkdir(parents=True)
    exported.mkdir()
    model = Transformer(FLAVORS["debug"])
    model.init_weights(seed=0)
    save_file(model.state_dict(), str(consolidated / model_io.WEIGHTS))
    model_io.write_args(consolidated, model.args, "fp32")
    export_prefill(model, exported / "model.onnx", opset=17)
    made = lambda stage, folder, **outputs: Manifest(
        stage=stage, status="completed", fingerprint=stage,
        outputs={k: file_entry(folder, v) for k, v in outputs.items()})
    skipped = Manifest(stage="convert_om", status="skipped", fingerprint="c", reason="CANN toolkit not found")
    return {"consolidate": (consolidated, made("consolidate", consolidated, model=model_io.WEIGHTS)),
            "export_onnx": (exported, made("export_onnx", exported, model="model.onnx")),
            "convert_om": (root / "om", skipped)}


def _ctx(root: Path, inputs, **benchmark) -> StageContext:
    cfg = from_dict({"run": {"name": "t", "artifacts_dir": str(root / "artifacts")},
                     "data": {"inputs": ["x"]},
                     "benchmark": {"shapes": SHAPES, "warmup": 1, "iters": 3, "threads": 2, **benchmark}})
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


def test_om_status_without_ais_bench(stage, monkeypatch):
    ctx, _, _, inputs = stage
    done = Manifest(stage="convert_om", status="completed", fingerprint="c")
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    ctx = _ctx(ctx.work_dir.parent, {**inputs, "convert_om": (Path("om"), done)})
    assert bench.om_status(ctx) == "om: not measured, ais_bench not found"


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
    from llmpipe.bench import ort as bench_ort

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
    from llmpipe.bench import ort as bench_ort

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
