"""The benchmark stage: ORT FP32 / FP16 / INT8 (and OM) vs PyTorch eager, per shape and provider.

Three parts, all in results.json and results.md:

- prefill throughput: for every provider, the FP32 ONNX graph first (the accuracy reference), then
  each variant, then PyTorch eager, on the same fixed random input ids per (batch, seq) shape
  (latency.png);
- generation (llmpipe.bench.llm): TTFT by prompt length, TPOT and decode tokens/s by batch, per
  engine (ttft.png, tpot.png), and a generated sample per engine;
- quality on validation text (llmpipe.bench.quality): perplexity, KL and top-1 of every variant
  against torch fp32, greedy-continuation agreement, the parity chain from the training checkpoint
  to the OM model, and the gates of benchmark.quality.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmpipe import device
from llmpipe.bench import llm, quality
from llmpipe.bench.plot import latency_plot, serving_plot
from llmpipe.device import OrtProvider
from llmpipe.errors import UserError
from llmpipe.export.onnx import check_external_data, check_shapes, random_ids
from llmpipe.infer.ort import ProviderUnavailable, Variant, create_session, make_variants, run_logits
from llmpipe.infer.stats import latency_stats, logit_agreement, speedup, throughput
from llmpipe.manifest import write_json_atomic
from llmpipe.models.llama.io import load_model, read_args
from llmpipe.stages import StageContext, StageError, StageResult

log = logging.getLogger("llmpipe.bench")

RESULTS_FILE, TABLE_FILE, PLOT_FILE, VARIANTS_DIR = "results.json", "results.md", "latency.png", "variants"
ORT_SUBDIR = "ort"  # variants/<name>/ort/: the variant's ORT-optimised graph (int4, int8w; llmpipe.export.fused)
TTFT_PLOT, TPOT_PLOT = "ttft.png", "tpot.png"
TORCH = "torch"  # the variant name of the PyTorch eager fp32 baseline rows
ORDER = (TORCH, "fp32", "fp16", "int8", "int8w", "int8s", "int4")

Shape = tuple[int, int]


@dataclass(frozen=True)
class Plan:
    """What every measurement shares: the inputs and how to time them."""

    inputs: dict[Shape, np.ndarray]  # (batch, seq) -> fixed random input ids (B, T) int64
    warmup: int
    iters: int
    threads: int


def time_calls(fn: Callable[[], Any], warmup: int, iters: int,
               sync: Callable[[], None] | None = None) -> list[float]:
    """`warmup` untimed calls, then the wall time (perf_counter seconds) of each of `iters` calls.
    `sync` waits for an asynchronous device so that the time covers the work."""
    sync = sync or (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return times


@contextlib.contextmanager
def torch_threads(n: int):
    """Temporarily set torch's intra-op thread count (a process-wide setting)."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _row(shape: Shape, provider: str, variant: str, seconds: list[float] | None = None,
         error: str | None = None) -> dict[str, Any]:
    batch, seq = shape
    row: dict[str, Any] = {"batch": batch, "seq": seq, "provider": provider, "variant": variant,
                           "backend": "torch" if variant == TORCH else "onnxruntime", "latency_ms": None,
                           "sequences_per_s": None, "tokens_per_s": None, "speedup_vs_torch": None,
                           "accuracy": None, "error": error}
    if seconds:
        row["latency_ms"] = latency_stats(seconds)
        # NOTE: throughput from the mean latency = work done / total timed wall time.
        row.update(throughput(batch, seq, row["latency_ms"]["mean"]))
    return row


def _log_row(row: dict[str, Any]) -> None:
    where = f"{row['provider']} {row['variant']} {row['batch']}x{row['seq']}"
    if row["error"]:
        log.warning("%s: %s", where, row["error"])
        return
    acc = row["accuracy"] or {}
    log.info("%s: p50 %.3f ms, p99 %.3f ms, %.0f tokens/s, max abs diff %s", where, row["latency_ms"]["p50"],
             row["latency_ms"]["p99"], row["tokens_per_s"], acc.get("max_abs_diff", "-"))


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"


def measure_variant(variant: Variant, provider: OrtProvider, plan: Plan, refs: dict[Shape, np.ndarray],
                    timed: bool = True) -> list[dict]:
    """Rows for one ORT variant on one provider, one per shape. The fp32 variant fills `refs`
    (shape -> logits); others are compared with it. A load or run failure becomes an error row,
    untimed (the fp32 reference when fp32 is not requested) or not: the stage judges them."""
    fail = lambda msg: [_row(s, provider.name, variant.name, error=msg) for s in plan.inputs]
    if variant.error:
        return fail(f"conversion failed: {variant.error}")
    try:
        session = create_session(variant.path, provider, plan.threads)
    except ProviderUnavailable as err:
        rows = fail(f"provider unavailable: {err}")
        for r in rows:
            r["provider_unavailable"] = True
        return rows
    except Exception as err:  # a variant that cannot load here is a result
        return fail(f"cannot load: {_error(err)}")
    rows = []
    for shape, ids in plan.inputs.items():
        try:
            call = partial(run_logits, session, ids)
            seconds = time_calls(call, plan.warmup, plan.iters) if timed else None
            logits = run_logits(session, ids)  # (B, T, vocab)
        except Exception as err:  # a failed run is a result too
            rows.append(_row(shape, provider.name, variant.name, error=f"run failed: {_error(err)}"))
            continue
        if variant.name == "fp32":
            refs[shape] = logits
        if not timed:
            continue
        row = _row(shape, provider.name, variant.name, seconds)
        if shape in refs:
            row["accuracy"] = logit_agreement(refs[shape], logits)
        _log_row(row)
        rows.append(row)
    return rows


def measure_torch(model: torch.nn.Module, provider: OrtProvider, plan: Plan,
                  refs: dict[Shape, np.ndarray]) -> list[dict]:
    """PyTorch eager fp32 rows on the provider's device type (inference_mode, `threads` threads)."""
    try:
        dev = device.resolve(provider.name)
    except RuntimeError as err:
        return [_row(s, provider.name, TORCH, error=_error(err)) for s in plan.inputs]
    model.to(dev)
    rows = []
    try:
        with torch.inference_mode(), torch_threads(plan.threads):
            for shape, ids in plan.inputs.items():
                x = torch.from_numpy(ids).to(dev)  # (B, T)
                seconds = time_calls(partial(model, x), plan.warmup, plan.iters,
                                     sync=partial(device.synchronize, dev))
                logits = model(x).float().cpu().numpy()  # (B, T, vocab)
                row = _row(shape, provider.name, TORCH, seconds)
                if shape in refs:  # ORT fp32 vs PyTorch: the export parity at this shape
                    row["accuracy"] = logit_agreement(refs[shape], logits)
                _log_row(row)
                rows.append(row)
    finally:
        model.to("cpu")
    return rows


def add_speedups(rows: list[dict]) -> None:
    """speedup_vs_torch = torch p50 / row p50, for rows with a torch row of the same shape and provider."""
    base = {(r["batch"], r["seq"], r["provider"]): r["latency_ms"]["p50"]
            for r in rows if r["variant"] == TORCH and r["latency_ms"]}
    for r in rows:
        key = (r["batch"], r["seq"], r["provider"])
        if r["latency_ms"] and key in base:
            r["speedup_vs_torch"] = speedup(base[key], r["latency_ms"]["p50"])


def notes(providers: Sequence[OrtProvider], variants: Sequence[str], threads: int, warmup: int, iters: int,
          torch_baseline: bool) -> list[str]:
    """Plain-language caveats that belong next to the numbers."""
    out = [f"Each row: {warmup} warm-up + {iters} timed calls on the same fixed random input ids; "
           f"{threads} intra-op threads for onnxruntime and PyTorch; tokens/s = batch*seq / mean latency.",
           "Accuracy columns compare with the FP32 onnxruntime variant on the same provider and inputs "
           "(for the torch row: PyTorch vs ONNX parity)."]
    if "fp16" in variants and any(p.name == "cpu" for p in providers):
        out.append("cpu: onnxruntime has no fast FP16 MatMul kernels on CPU, so the FP16 variant is not "
                   "expected to beat FP32 there; its CPU row shows the accuracy cost (FP16 pays on GPU/NPU).")
    if "int8" in variants:
        out.append("int8: dynamic quantization (QInt8 MatMul/Gemm weights, 7-bit reduce_range; activations "
                   "quantized per call); its gain grows with model size, on tiny models overhead can win.")
    if "int4" in variants or "int8w" in variants:
        out.append("int4 / int8w: weight-only MatMulNBits (onnxruntime contrib op, block-wise scales; settings in "
                   "benchmark.quantize): onnxruntime only, the portable graphs ATC reads are unchanged.")
    if "int8s" in variants:
        out.append("int8s: static quantization (int8 weights per channel, uint8 activations with ranges calibrated "
                   "on validation text; benchmark.quantize): its gain needs integer kernels, tiny models can lose.")
    if "fp32" not in variants:
        out.append("fp32 is not in benchmark.variants: it ran untimed, as the accuracy reference.")
    if not torch_baseline:
        out.append("benchmark.torch_baseline is false: no PyTorch rows, no speed-up column.")
    return out


def benchmark(variants: dict[str, Variant], providers: Sequence[OrtProvider],
              shapes: Sequence[Sequence[int]], *, requested: Sequence[str], vocab_size: int, warmup: int,
              iters: int, threads: int | None = None, seed: int = 0,
              torch_model: torch.nn.Module | None = None, root: Path | None = None) -> dict:
    """Measure every requested variant (and PyTorch eager when `torch_model` is given) on every
    provider and shape. Returns the results dict written to results.json."""
    threads = threads or os.cpu_count() or 1
    shapes = [(int(b), int(s)) for b, s in shapes]
    inputs = {shape: random_ids(*shape, vocab_size, seed + i) for i, shape in enumerate(shapes)}
    plan = Plan(inputs, warmup, iters, threads)
    rows: list[dict] = []
    for provider in providers:
        refs: dict[Shape, np.ndarray] = {}
        for name in ["fp32", *(v for v in requested if v != "fp32")]:
            rows += measure_variant(variants[name], provider, plan, refs, timed=name in requested)
        if torch_model is not None:
            rows += measure_torch(torch_model, provider, plan, refs)
    add_speedups(rows)
    pnames = [p.name for p in providers]
    rows.sort(key=lambda r: (shapes.index((r["batch"], r["seq"])), pnames.index(r["provider"]),
                             ORDER.index(r["variant"])))
    return {
        "threads": threads, "warmup": warmup, "iters": iters, "seed": seed,
        "shapes": [list(s) for s in shapes], "providers": pnames,
        "variants": {n: {"file": _shown(v.path, root), "bytes": v.nbytes(), "error": v.error}
                     for n, v in variants.items()},
        "rows": rows,
        "notes": notes(providers, requested, threads, warmup, iters, torch_model is not None),
    }


def _shown(path: Path | None, root: Path | None) -> str | None:
    if path is None:
        return None
    if root is not None and path.resolve().is_relative_to(root.resolve()):
        return path.resolve().relative_to(root.resolve()).as_posix()
    return str(path)


def load_results(folder: str | Path) -> dict:
    """The results dict of a finished benchmark stage folder (its results.json)."""
    return json.loads((Path(folder) / RESULTS_FILE).read_text(encoding="utf-8"))


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table_rows(results: dict) -> list[dict[str, Any]]:
    """One flat dict per measurement (for a Prefect table artifact); None where not measured."""
    out = []
    for r in results["rows"]:
        lat, acc = r["latency_ms"] or {}, r["accuracy"] or {}
        out.append({
            "shape": f"{r['batch']}x{r['seq']}", "provider": r["provider"], "variant": r["variant"],
            "p50_ms": lat.get("p50"), "p90_ms": lat.get("p90"), "p99_ms": lat.get("p99"),
            "tokens_per_s": r["tokens_per_s"], "speedup_vs_torch": r["speedup_vs_torch"],
            "max_abs_diff": acc.get("max_abs_diff"), "top1_agreement": acc.get("top1_agreement"),
            "error": r["error"],
        })
    return out


def markdown_table(results: dict, with_notes: bool = True) -> str:
    """The results as a markdown table (shape, provider, variant, latencies, tokens/s, speed-up,
    accuracy), followed by the notes unless `with_notes` is false."""
    lines = ["| shape | provider | variant | p50 ms | p90 ms | p99 ms | tokens/s | speedup vs torch "
             "| max abs diff | top-1 |", "|---|---|---|--:|--:|--:|--:|--:|--:|--:|"]
    for t in table_rows(results):
        if t["error"]:
            cells = [t["error"][:120].replace("|", "/")] + ["-"] * 6
        else:
            cells = [_fmt(t["p50_ms"], ".2f"), _fmt(t["p90_ms"], ".2f"), _fmt(t["p99_ms"], ".2f"),
                     _fmt(t["tokens_per_s"], ",.0f"),
                     "-" if t["speedup_vs_torch"] is None else f"{t['speedup_vs_torch']:.2f}x",
                     _fmt(t["max_abs_diff"], ".2e"), _fmt(t["top1_agreement"], ".3f")]
        lines.append("| " + " | ".join([t["shape"], t["provider"], t["variant"], *cells]) + " |")
    if with_notes and results.get("notes"):
        lines += ["", *(f"- {n}" for n in results["notes"])]
    return "\n".join(lines) + "\n"


def summary(results: dict) -> dict[str, Any]:
    """Compact manifest metrics: per provider/variant p50, speed-up and accuracy at the first shape."""
    b, s = results["shapes"][0]
    first = [r for r in results["rows"] if (r["batch"], r["seq"]) == (b, s) and r["latency_ms"]]
    key = lambda r: f"{r['provider']}/{r['variant']}"
    return {
        "shape": f"{b}x{s}", "threads": results["threads"],
        "p50_ms": {key(r): round(r["latency_ms"]["p50"], 4) for r in first},
        "speedup_vs_torch": {key(r): round(r["speedup_vs_torch"], 3) for r in first
                             if r["speedup_vs_torch"] is not None and r["variant"] != TORCH},
        "max_abs_diff": {key(r): r["accuracy"]["max_abs_diff"] for r in first if r["accuracy"]},
        "top1_agreement": {key(r): r["accuracy"]["top1_agreement"] for r in first if r["accuracy"]},
        "errors": sum(1 for r in results["rows"] if r["error"]),
        **_llm_summary(results),
        **({"serving_tokens_per_s": {str(r["concurrency"]): round(r["output_tokens_per_s"], 2)
                                     for r in results["serving"]["rows"]}} if results.get("serving") else {}),
    }


def _llm_summary(results: dict) -> dict[str, Any]:
    """Per provider/variant: decode tokens/s and TPOT at the smallest batch, TTFT at the longest prompt,
    perplexity / KL / top-1 on validation text, and the rejected variants."""
    out: dict[str, Any] = {}
    llm_r, q = results.get("llm"), results.get("quality")
    key = lambda r: f"{r['provider']}/{r['variant']}"
    if llm_r:
        decode = [r for r in llm_r["decode"] if not r.get("error")]
        if decode:
            b = min(r["batch"] for r in decode)
            out["decode_batch"] = b
            out["decode_tokens_per_s"] = {key(r): round(r["decode_tokens_per_s"], 2) for r in decode if r["batch"] == b}
            out["tpot_ms"] = {key(r): round(r["tpot_ms"], 4) for r in decode if r["batch"] == b}
        prefill = [r for r in llm_r["prefill"] if not r.get("error")]
        if prefill:
            t = max(r["prompt_len"] for r in prefill)
            out["ttft_prompt_len"] = t
            out["ttft_ms"] = {key(r): round(r["ttft_ms"], 4) for r in prefill if r["prompt_len"] == t}
    if q:
        for metric in ("ppl", "kl", "top1"):
            out[metric] = {name: v[metric] for name, v in q["variants"].items()}
        out["rejected"] = q["rejected"]
        out["verdicts"] = {name: v.get("verdict") for name, v in q["variants"].items()}
        out["rejected_because"] = {name: v["rejected_because"] for name, v in q["variants"].items()
                                   if "rejected_because" in v}
    return out


def check_measured(results: dict, requested: Sequence[str], auto_providers: bool) -> None:
    """StageError (one line) unless the benchmark measured something: the fp32 reference must run on
    every provider (the other variants' accuracy is measured against it) and at least one requested
    ONNX variant must have numbers. With benchmark.providers auto, a provider onnxruntime lists but
    cannot enable here is left out with a warning instead."""
    rows = results["rows"]
    gone = sorted({r["provider"] for r in rows if r.get("provider_unavailable")}) if auto_providers else []
    for name in gone:
        log.warning("benchmark: provider %s is listed by onnxruntime but could not be enabled; not measured", name)
    onnx_rows = [r for r in rows if r["variant"] != TORCH and r["provider"] not in gone]
    ref = next((r for r in onnx_rows if r["variant"] == "fp32" and r["error"]), None)
    if ref is not None:
        raise StageError(f"benchmark: the fp32 reference failed on {ref['provider']} at {ref['batch']}x{ref['seq']}: "
                         f"{ref['error']}")
    if not any(r["latency_ms"] for r in onnx_rows if r["variant"] in requested):
        first = next((f"{r['variant']}: {r['error']}" for r in onnx_rows if r["error"]), "no provider could run")
        raise StageError(f"benchmark: no ONNX variant produced numbers (benchmark.variants: "
                         f"{', '.join(requested)}; first error: {first})")


def om_models(ctx: StageContext) -> tuple[Any, str | None]:
    """(OmModels, None) when both OM models exist and ais_bench can run them here, else (None, why)."""
    entry = ctx.inputs.get("convert_om")
    if entry is None:
        return None, "no convert_om result"
    folder, manifest = entry
    if manifest.status != "completed":
        why = f" ({manifest.reason})" if manifest.reason else ""
        return None, f"convert_om was {manifest.status}{why}"
    if "decoder_om" not in manifest.outputs:
        return None, "convert_om compiled no decoder.om (convert_om.decoder or export.static_decoder is false)"
    from llmpipe.bench.deploy import OmModels
    from llmpipe.export.atc import prefill_gears
    from llmpipe.infer import ais

    reason = ais.unavailable_reason()
    if reason:
        return None, reason
    section = ctx.cfg.convert_om
    gears = prefill_gears(section.dynamic_dims)
    return OmModels(manifest.path(folder, "om"), manifest.path(folder, "decoder_om"), gears,
                    section.decode_batch, ctx.cfg.benchmark.device_id), None


def calibration_windows(ctx: StageContext, max_seq_len: int) -> np.ndarray | None:
    """The calibration windows of validation text of int8s, and of int8 with SmoothQuant's scales
    (benchmark.quantize.smooth_alpha); None when neither is requested. A sample larger than the validation shard
    holds is a StageError naming the field, before any variant is made."""
    from llmpipe.bench import calibrate

    cfg = ctx.cfg.benchmark
    if "int8s" not in cfg.variants and not ("int8" in cfg.variants and cfg.quantize.smooth_alpha is not None):
        return None
    q = cfg.quantize
    T = min(q.calibration_seq_len or cfg.quality.seq_len or ctx.cfg.data.seq_len, max_seq_len)
    # NOTE: seed + 1: not the quality sample's own draw (it may still share windows with a small shard).
    return calibrate.windows(ctx.input_path("prepare_data", "val_bin"), q.calibration_samples, T, ctx.cfg.run.seed + 1)


def _models(ctx: StageContext, args, torch_model, variants, threads: int, calib: np.ndarray | None = None):
    """What the generation benchmark and the quality measurement run (llmpipe.bench.deploy.Models)."""
    from llmpipe.bench import calibrate
    from llmpipe.bench.deploy import Models
    from llmpipe.infer.graphs import STATIC_FILE

    cfg = ctx.cfg.benchmark
    export = ctx.inputs["export_onnx"][1]
    static: dict[str, Variant] = {}
    if "decoder_static" in export.outputs:
        path = ctx.input_path("export_onnx", "decoder_static")
        check_external_data(path)
        reader = None if calib is None else partial(
            calibrate.decoder_reader, ctx.input_path("export_onnx", "model"), path, args,
            export.metrics.get("static_decoder_cache_len"), calib, cfg.quantize.calibration_decode_steps,
            device.ort_providers(["cpu"])[0], threads)
        static = make_variants(path, list(cfg.variants), ctx.work_dir / VARIANTS_DIR, filename=STATIC_FILE,
                               quantize=cfg.quantize, calibration=reader, lora=lora_folders(ctx))
    om, om_reason = om_models(ctx)
    return Models(args, torch_model, variants, static, export.metrics.get("static_decoder_cache_len"), threads,
                  om, om_reason, list(cfg.variants), ort_graphs(ctx))


def ort_graphs(ctx: StageContext) -> dict[str, Path]:
    """Variant -> its ORT-optimised graph folder, when export_onnx wrote ort/ (export.ort_graph): fp32 that
    ort/; int4 / int8w (when requested) the weight-only graph of consolidate's hf/ at benchmark.quantize's
    settings (fused.build_weight_only: MatMulNBits, the same bits, algorithm, head width, block size, accuracy
    level and symmetry as their portable graphs), written to variants/<name>/ort/. A builder failure fails the
    stage (one line, its log named): the fp32 graph of the same builder has already run in export_onnx."""
    from llmpipe.export import fused

    export = ctx.inputs["export_onnx"][1]
    if "ort_graph/model.onnx" not in export.outputs:
        return {}
    out = {"fp32": ctx.input_path("export_onnx", "ort_graph/model.onnx").parent}
    cfg = ctx.cfg.benchmark
    folder, manifest = ctx.inputs["consolidate"]
    hf = manifest.path(folder, "hf/config.json").parent
    adapter = lora_adapter(folder, manifest)
    for name in fused.ORT_VARIANTS:
        section = getattr(cfg.quantize, name)
        options = fused.weight_only_options(section) if name in cfg.variants else None
        if options is None:
            continue
        if section.adapter == "separate" and adapter is None:
            raise StageError(f"benchmark.quantize.{name}.adapter: separate, but consolidate wrote no LoRA adapter "
                             f"(adapter/ in {folder})")
        t0 = time.perf_counter()
        try:
            out[name] = fused.build_weight_only(hf, ctx.work_dir / VARIANTS_DIR / name / ORT_SUBDIR, section,
                                                adapter_dir=adapter).parent
        except StageError as err:
            raise StageError(f"benchmark: the {name} variant's {err}") from None
        kept = ", the LoRA adapter kept separate" if adapter is not None and section.adapter == "separate" else ""
        log.info("variant %s: ORT-optimised graph (%s, %s, %s%s) in %.1fs", name, section.algorithm, options[0],
                 " ".join(f"{k}={v}" for k, v in options[1].items()), kept, time.perf_counter() - t0)
    return out


def lora_hint(cfg, rejected: Sequence[str]) -> str | None:
    """What to try when a LoRA run's int4 of the merged weights was rejected (a delta below a 4-bit step is
    what the chat demo's fine-tune of the 4-bit-shipped SmolLM2 has), or None."""
    q = cfg.benchmark.quantize.int4
    if "int4" not in rejected or cfg.train.lora is None or q.adapter != "merged" or not cfg.export.ort_graph:
        return None
    return ("int4: rejected on a LoRA run. When the fine-tune's weight changes are below a 4-bit step (a base that "
            "came from a 4-bit file), int4 of the merged weights rounds them away; benchmark.quantize.int4.adapter: "
            "separate (with algorithm hqq, zero_points integer) keeps the adapter apart from the 4-bit base "
            "(docs/measurements/quantisation.md).")


def lora_folders(ctx: StageContext) -> tuple[Path, Path] | None:
    """(consolidate's hf/, its adapter/) for a LoRA run that keeps the adapter separate in a weight-only
    variant's portable graphs; None otherwise."""
    q = ctx.cfg.benchmark.quantize
    if not any(getattr(q, n).adapter == "separate" for n in ("int4", "int8w") if n in ctx.cfg.benchmark.variants):
        return None
    folder, manifest = ctx.inputs["consolidate"]
    adapter = lora_adapter(folder, manifest)
    if adapter is None:
        raise StageError(f"benchmark.quantize: adapter separate, but consolidate wrote no LoRA adapter (adapter/ in "
                         f"{folder})")
    return manifest.path(folder, "hf/config.json").parent, adapter


def lora_adapter(folder: Path, manifest) -> Path | None:
    """A LoRA run's adapter folder (PEFT's files, consolidate's adapter/), for a variant that keeps it separate
    (benchmark.quantize.<v>.adapter); None when consolidate wrote none. Both files must resolve inside
    consolidate's folder (ManifestError otherwise)."""
    if not {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(manifest.outputs):
        return None
    manifest.path(folder, "adapter/adapter_config.json")
    return manifest.path(folder, "adapter/adapter_model.safetensors").parent


def chat_sample(ctx: StageContext, tokenizer) -> tuple | None:
    """A chat run's generated sample (llm.sample_text's arguments): benchmark.llm.sample_prompt asked as a
    user's question in the run's chat template (checked against training's digest first), its answer
    ending at eos or the template's end of turn; None for a text run."""
    from llmpipe.checkpoint.template_digest import consolidated_template
    from llmpipe.models.llama.hf_files import single_token_ids

    found = consolidated_template(ctx.run_dir, *ctx.inputs["consolidate"])
    if found is None:
        return None
    tpl, render = found
    prompt = tpl.render([{"role": "user", "content": ctx.cfg.benchmark.llm.sample_prompt}],
                        add_generation_prompt=True, bos_token=render.get("bos_token", ""),
                        eos_token=render.get("eos_token", ""))
    eos = tokenizer.token_to_id(render.get("eos_token") or ctx.cfg.data.tokenizer.eos_token)
    stops = ([eos] if eos is not None else []) + single_token_ids(tokenizer, tpl.end_of_turn)
    return prompt, ctx.cfg.benchmark.llm.sample_tokens, stops, tpl.end_of_turn


def gguf_results(ctx: StageContext, models, threads: int) -> dict[str, Any] | None:
    """export.gguf's files in llama.cpp, gated as gguf_<type> (llmpipe.bench.gguf_variants), scored on the
    quality measurement's windows; None when export_onnx wrote none."""
    from llmpipe.bench import deploy, gguf_variants, quality

    folder, manifest = ctx.inputs["export_onnx"]
    found = gguf_variants.files(folder, manifest)
    if not found:
        return None
    cfg = ctx.cfg.benchmark
    ids = ref = None
    if gguf_variants.unavailable_reason() is None:
        T = min(cfg.quality.seq_len or ctx.cfg.data.seq_len, models.args.max_seq_len)
        ids = quality.val_sample(ctx.input_path("prepare_data", "val_bin"), cfg.quality.samples, T, ctx.cfg.run.seed)
        ref = deploy._logits_torch(models.torch_model, ids)  # the same windows and reference as quality_results
    return gguf_variants.results(found, ids, ref, cfg, threads, models.args.vocab_size, ctx.cfg.run.seed,
                                 gguf_variants.adapter(folder, manifest))


SERVING_PLOT, SERVING_LOG = "serving.png", "serving.log"


def serving_results(ctx: StageContext, threads: int) -> dict[str, Any]:
    """benchmark.serving: `llmpipe serve` of this run on a free loopback port, measured at each concurrency
    (llmpipe.bench.serving) and stopped. The stage's own gates are not published yet, so the server is
    started with --allow-ungated (its log, serving.log, says so)."""
    from dataclasses import asdict

    from llmpipe.bench import serving

    s = ctx.cfg.benchmark.serving
    try:
        prompts = serving.prompts_from_run(ctx.run_dir, s.requests, s.prompt_tokens, ctx.cfg.run.seed)
        extra = ["--allow-ungated", "--threads", str(threads)]
        with serving.LocalServer(ctx.run_dir, s.variant, max(s.concurrency), ctx.work_dir / SERVING_LOG,
                                 extra) as server:
            model = serving.first_model(server.url, None)
            rows = serving.measure(server.url, model, prompts, s.concurrency, s.max_tokens,
                                   seed=ctx.cfg.run.seed, progress=lambda text: log.info("serving: %s", text))
    except UserError as err:
        raise StageError(f"benchmark.serving: {err}") from None
    return {"model": model, "requests": s.requests, "prompt_tokens": s.prompt_tokens, "max_tokens": s.max_tokens,
            "rows": [asdict(r) for r in rows]}


def serving_markdown(serving: dict | None) -> str:
    if not serving:
        return ""
    from llmpipe.bench.serving import DEFINITIONS, LoadResult, table

    return (f"\n## Serving\n\n`llmpipe serve` ({serving['model']}) under load: {serving['requests']} requests of "
            f"{serving['prompt_tokens']} prompt tokens, up to {serving['max_tokens']} new tokens each, streamed.\n\n"
            f"{table([LoadResult(**r) for r in serving['rows']])}\n\n{DEFINITIONS}\n")


def run(ctx: StageContext) -> StageResult:
    """The benchmark stage: results.json, results.md, the plots and variants/ in ctx.work_dir."""
    from llmpipe.bench import calibrate, deploy, gguf_variants
    from llmpipe.bench.plot import tpot_plot, ttft_plot
    from llmpipe.data.tokenizer import load_tokenizer
    from llmpipe.models.llama.io import TOKENIZER

    cfg = ctx.cfg.benchmark
    onnx_path = ctx.input_path("export_onnx", "model")
    model_dir = ctx.input_path("consolidate", "model").parent
    try:
        args = read_args(model_dir)
        providers = device.ort_providers(cfg.providers)
    except ValueError as err:
        raise StageError(str(err)) from None
    check_shapes(cfg.shapes, args.max_seq_len, "benchmark.shapes")
    check_external_data(onnx_path)  # before onnxruntime or a converter opens what it points at
    calib = calibration_windows(ctx, args.max_seq_len)
    threads = cfg.threads or os.cpu_count() or 1
    variants = make_variants(onnx_path, list(cfg.variants), ctx.work_dir / VARIANTS_DIR, quantize=cfg.quantize,
                             calibration=None if calib is None else partial(calibrate.prefill_reader, calib),
                             lora=lora_folders(ctx))
    torch_model = load_model(model_dir, dtype=torch.float32)
    results = benchmark(variants, providers, cfg.shapes, requested=list(cfg.variants),
                        vocab_size=args.vocab_size, warmup=cfg.warmup, iters=cfg.iters, threads=threads,
                        seed=ctx.cfg.run.seed, torch_model=torch_model if cfg.torch_baseline else None,
                        root=ctx.work_dir)
    check_measured(results, list(cfg.variants), auto_providers=cfg.providers == "auto")
    models = _models(ctx, args, torch_model, variants, threads, calib)
    tokenizer = load_tokenizer(model_dir / TOKENIZER)
    with torch_threads(threads):
        results["llm"] = deploy.llm_results(models, providers, cfg, tokenizer, ctx.cfg.run.seed,
                                            chat_sample(ctx, tokenizer))
        nowhere = llm.failed_everywhere(results["llm"], cfg.llm.prompt_lens, cfg.llm.batches)
        if nowhere:
            raise StageError(f"benchmark: {nowhere}")
        results["quality"] = deploy.quality_results(models, ctx.input_path("prepare_data", "val_bin"),
                                                    ctx.inputs["train"][0], cfg, ctx.cfg.data.seq_len,
                                                    ctx.cfg.run.seed)
        results["gguf"] = gguf_results(ctx, models, threads)
    verdicts = results["quality"].pop("verdicts")
    if results["gguf"] is not None:
        verdicts = [*verdicts, *results["gguf"].pop("verdicts")]
    hint = lora_hint(ctx.cfg, [v.variant for v in verdicts if not v.passed])
    if hint:
        log.warning("%s", hint)
        results["notes"].append(hint)
    if cfg.serving.enabled:
        results["serving"] = serving_results(ctx, threads)
    results["om"] = "om: measured through ais_bench" if models.om else f"om: not measured, {models.om_reason}"
    results["notes"].append(results["om"])
    write_json_atomic(ctx.work_dir / RESULTS_FILE, results)
    (ctx.work_dir / TABLE_FILE).write_text(
        f"# Benchmark: {ctx.cfg.run.name}\n\n## Prefill throughput\n\n{markdown_table(results)}\n"
        f"## Generation\n\n{llm.markdown(results['llm'])}\n## Quality\n\n"
        f"{deploy.quality_markdown(results['quality'])}{gguf_variants.markdown(results.get('gguf'))}"
        f"{serving_markdown(results.get('serving'))}", encoding="utf-8")
    latency_plot(results, ctx.work_dir / PLOT_FILE)
    ttft_plot(results["llm"], ctx.work_dir / TTFT_PLOT)
    tpot_plot(results["llm"], ctx.work_dir / TPOT_PLOT)
    outputs = {"results": RESULTS_FILE, "table": TABLE_FILE, "plot": PLOT_FILE, "ttft_plot": TTFT_PLOT,
               "tpot_plot": TPOT_PLOT}
    if "serving" in results:
        serving_plot(results["serving"], ctx.work_dir / SERVING_PLOT)
        outputs.update(serving_plot=SERVING_PLOT, serving_log=SERVING_LOG)
    if any(p.is_file() for p in (ctx.work_dir / VARIANTS_DIR).rglob("*")):
        outputs["variants"] = VARIANTS_DIR
    # NOTE: after results.json / results.md are written: a failing stage's folder (kept under failed/) holds
    # every variant's numbers, and a rejected variant that is not required costs no measurement
    quality.enforce_gates(verdicts, cfg.quality.enforce, cfg.require)
    return StageResult(outputs=outputs, metrics=summary(results))
