"""The deployment half of the benchmark stage: which engines exist (PyTorch eager, onnxruntime
variants with the static decoder, OM models through ais_bench, and on the CPU the ORT-optimised graphs:
fp32 through export_onnx's ort/, int4 / int8w through the builder's weight-only graphs of
benchmark/variants/<name>/ort/), their generation numbers (llmpipe.bench.llm), and their quality on
validation text along the parity chain with the gates of benchmark.quality (llmpipe.bench.quality).

A variant with an ORT-optimised graph is deployed through it on the CPU (generate, the benchmark's
generation rows, evaluate): its gates judge that graph, and its portable graphs too (what other providers
and ATC's path run); it passes only when both do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from llmpipe import device
from llmpipe.bench import llm, quality
from llmpipe.config import BenchmarkSection
from llmpipe.device import OrtProvider
from llmpipe.infer.decode import StaticEngine, TorchEngine, generate
from llmpipe.infer.ort import Variant, create_session
from llmpipe.models.llama.model import ModelArgs, Transformer
from llmpipe.stages import StageError

log = logging.getLogger("llmpipe.bench")

OM = "om"
BRANCHES = ("int4", "int8w", "int8s")  # variants off the chain's main line (checkpoint -> fp32 -> fp16 -> int8 -> OM)


@dataclass
class OmModels:
    """convert_om's two OM models and what they were compiled for."""

    prefill: Path
    decoder: Path
    gears: list[int]  # prefill sequence lengths (convert_om.dynamic_dims), [] when static
    batch: int  # convert_om.decode_batch
    device_id: int


@dataclass
class Models:
    """Everything the benchmark can run, built once by the stage."""

    args: ModelArgs
    torch_model: Transformer
    prefill: dict[str, Variant]  # fp32 / fp16 / int8 of model.onnx
    static: dict[str, Variant]  # the same of decoder_static.onnx; empty without one
    cache_len: int | None  # the static decoder's cache slots
    threads: int
    om: OmModels | None = None
    om_reason: str | None = None  # why there are no OM numbers
    requested: list[str] = field(default_factory=list)
    # variant -> its ORT-optimised graph folder (llmpipe.export.fused): what the CPU runs for it
    fused: dict[str, Path] = field(default_factory=dict)


def _fused_engine(m: Models, name: str, provider: OrtProvider, cache_len: int | None = None):
    from llmpipe.infer.fused import FusedEngine, GraphConfig

    folder = m.fused[name]
    return FusedEngine(create_session(folder / "model.onnx", provider, m.threads), GraphConfig.read(folder),
                       cache_len or m.cache_len or m.args.max_seq_len)


def _ort_engine(m: Models, name: str, provider: OrtProvider):
    """On the CPU, FusedEngine over the variant's ORT-optimised graph when it has one; else StaticEngine over
    the variant's prefill graph and static decoder."""
    if name in m.fused and provider == device.ort_providers(["cpu"])[0]:
        return _fused_engine(m, name, provider)
    prefill, static = m.prefill[name], m.static[name]
    for v in (prefill, static):
        if v.error:
            raise RuntimeError(f"conversion failed: {v.error}")
    return StaticEngine(create_session(prefill.path, provider, m.threads),
                        create_session(static.path, provider, m.threads), m.args, m.cache_len)


def _om_engine(m: Models) -> StaticEngine:
    from llmpipe.infer.ais import OmSession

    om = m.om
    return StaticEngine(OmSession(om.prefill, device_id=om.device_id, dynamic=bool(om.gears)),
                        OmSession(om.decoder, device_id=om.device_id), m.args, m.cache_len,
                        prefill_lens=om.gears or None, batch=om.batch)


def _torch_engine(m: Models, provider: OrtProvider) -> TorchEngine:
    dev = device.resolve(provider.name)
    return TorchEngine(m.torch_model.to(dev), dev)


def engines(m: Models, providers: Sequence[OrtProvider], torch_baseline: bool) -> list[tuple[str, str, Callable]]:
    """(variant, provider, opener) for every engine to measure; the torch baseline first."""
    out = []
    for p in providers:
        if torch_baseline:
            out.append(("torch", p.name, partial(_torch_engine, m, p)))
        if m.static:
            out += [(name, p.name, partial(_ort_engine, m, name, p)) for name in m.requested]
    if m.om is not None:
        out.append((OM, "npu", partial(_om_engine, m)))
    return out


def llm_results(m: Models, providers: Sequence[OrtProvider], cfg: BenchmarkSection, tokenizer, seed: int,
                sample: tuple | None = None) -> dict:
    """results["llm"]: prefill and decode rows per engine (with ratios to torch), samples, definitions.
    `sample`: llm.sample_text's (prompt, tokens[, stop ids, stop strings]); default benchmark.llm's prompt."""
    c = cfg.llm
    plan = llm.LlmPlan(c.prompt_lens, c.batches, c.decode_prompt_len, c.new_tokens, c.repeats,
                       m.args.vocab_size, seed)
    measured = []
    for name, provider, opener in engines(m, providers, cfg.torch_baseline):
        measured.append(llm.measure_engine(name, provider, opener, plan, tokenizer,
                                           sample or (c.sample_prompt, c.sample_tokens)))
        m.torch_model.to("cpu")
    prefill, decode = llm.flat_rows(measured, "prefill"), llm.flat_rows(measured, "decode")
    if m.om is None:
        why = m.om_reason or "no OM model"
        prefill.append({"variant": OM, "provider": "npu", "error": f"not measured: {why}"})
        decode.append({"variant": OM, "provider": "npu", "error": f"not measured: {why}"})
    llm.add_ratios(decode, prefill)
    if not m.static:
        note = "no decoder_static.onnx (export.static_decoder: false): onnxruntime generation not measured"
        decode.append({"variant": "onnx", "provider": "-", "error": note})
    return {"cache_len": m.cache_len, "definitions": llm.DEFINITIONS, "prefill": prefill, "decode": decode,
            "samples": {f"{x['provider']}/{x['variant']}": x["sample"] for x in measured if x["sample"]}}


# --------------------------------------------------------------------------- quality


def _logits_torch(model: torch.nn.Module, ids: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        return np.concatenate([model(torch.from_numpy(ids[i:i + 4])).float().numpy()
                               for i in range(0, len(ids), 4)])  # (N, T, vocab)


def _logits_ort(v: Variant, threads: int, ids: np.ndarray) -> np.ndarray:
    session = create_session(v.path, device.ort_providers(["cpu"])[0], threads)
    return np.concatenate([session.run(["logits"], {"input_ids": ids[i:i + 4]})[0] for i in range(0, len(ids), 4)])


def _logits_fused(m: Models, name: str, ids: np.ndarray) -> np.ndarray:
    """The prompt pass of the variant's ORT-optimised graph over each row of `ids` (FusedEngine.prompt)."""
    engine = _fused_engine(m, name, device.ort_providers(["cpu"])[0], max(m.cache_len or 0, ids.shape[1]))
    return np.concatenate([engine.prompt(ids[i:i + 4]) for i in range(0, len(ids), 4)])


def _logits_om(m: Models, ids: np.ndarray) -> np.ndarray:
    """OM prefill, one row at a time (it is compiled for batch 1), padded to a gear."""
    engine = _om_engine(m)
    T = ids.shape[1]
    out = []
    for row in ids:
        padded = engine._padded(row[None])  # (1, gear)
        out.append(engine.prefill.run(["logits"], {"input_ids": padded})[0][:, :T])
    return np.concatenate(out)


def _hop(name: str, compute: Callable[[], np.ndarray]) -> tuple[str, np.ndarray | None, str | None]:
    try:
        return name, compute(), None
    except (StageError, RuntimeError, ValueError, OSError) as err:
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("quality: %s not measured: %s", name, text)
        return name, None, text


def _continuations(m: Models, ids: np.ndarray, cfg) -> dict[str, dict]:
    """Greedy continuation agreement of every ORT variant (CPU) and the OM with torch fp32."""
    n = min(cfg.continuation_prompts, len(ids))
    if n == 0 or not m.static:
        return {}
    prompts = ids[:n, : max(1, ids.shape[1] // 2)]
    k = cfg.continuation_tokens
    if prompts.shape[1] + k > (m.cache_len or 0):
        k = max(1, (m.cache_len or 0) - prompts.shape[1])
    ref = generate(TorchEngine(m.torch_model), prompts, k).tokens
    out = {}
    cpu = device.ort_providers(["cpu"])[0]
    for name in m.requested:
        try:
            out[name] = quality.continuation_agreement(ref, generate(_ort_engine(m, name, cpu), prompts, k).tokens)
        except (RuntimeError, ValueError) as err:
            out[name] = {"error": str(err).splitlines()[0]}
    if m.om is not None and m.om.batch == 1:
        try:
            engine = _om_engine(m)
            om = np.concatenate([generate(engine, p[None], k).tokens for p in prompts])
            out[OM] = quality.continuation_agreement(ref, om)
        except (RuntimeError, ValueError) as err:
            out[OM] = {"error": str(err).splitlines()[0]}
    return out


def quality_results(m: Models, val_bin: Path, train_dir: Path, cfg: BenchmarkSection, seq_len: int,
                    seed: int) -> dict[str, Any]:
    """results["quality"]: per-variant metrics vs torch fp32 on validation text, continuation
    agreement, the parity chain, the verdicts (judged, not enforced: run() enforces them after writing the
    results, so a failing stage keeps its measurements)."""
    q = cfg.quality
    T = min(q.seq_len or seq_len, m.args.max_seq_len)
    ids = quality.val_sample(val_bin, q.samples, T, seed)  # (N, T)
    ref = _logits_torch(m.torch_model, ids)
    hops = [_hop("training checkpoint", lambda: _logits_torch(quality.checkpoint_logits_model(train_dir), ids)),
            ("consolidated weights (torch fp32)", ref, None)]
    per_variant: dict[str, dict] = {}
    for name in ["fp32", *(v for v in m.requested if v != "fp32")]:
        v = m.prefill[name]
        hop = (f"ONNX {name}", None, f"conversion failed: {v.error}") if v.error else \
            _hop(f"ONNX {name}", partial(_logits_ort, v, m.threads, ids))
        hops.append(hop)
        if hop[1] is not None and name in m.requested:
            per_variant[name] = quality.text_metrics(ids, ref, hop[1])
    if m.om is not None:
        hop = _hop("OM", partial(_logits_om, m, ids))
        if hop[1] is not None:
            per_variant[OM] = quality.text_metrics(ids, ref, hop[1])
    else:
        hop = ("OM", None, m.om_reason or "no OM model")
    hops.append(hop)
    # the ORT-optimised graphs, each made from the consolidated weights by the builder: what the CPU deploys
    # for the variant, so its metrics become the variant's (the portable graphs' kept beside, both judged)
    branches = {f"ONNX {n}": "ONNX fp32" for n in BRANCHES}
    portable: dict[str, dict] = {}
    for name in [n for n in per_variant if n in m.fused]:
        hop = _hop(f"ORT graph {name}", partial(_logits_fused, m, name, ids))
        hops.append(hop)
        branches[hop[0]] = "consolidated weights (torch fp32)"
        if hop[1] is None:
            raise StageError(f"benchmark: {name}'s ORT-optimised graph ({m.fused[name]}) could not score the "
                             f"validation text: {hop[2]}")
        portable[name] = per_variant[name]
        per_variant[name] = {**quality.text_metrics(ids, ref, hop[1]), "graph": "ORT-optimised",
                             "portable": portable[name]}
    for name, agree in _continuations(m, ids, q).items():
        if name in per_variant:
            per_variant[name]["continuation"] = agree
    verdicts = quality.judge(per_variant, q, sequences=len(ids))
    # a variant deployed through its ORT-optimised graph passes only when its portable graphs pass too
    for i, v in enumerate(verdicts):
        if v.variant in portable:
            metrics, graph = (portable[v.variant], "portable graphs") if v.passed else \
                (per_variant[v.variant], "ORT-optimised graph")
            verdicts[i] = quality.judge({v.variant: metrics}, q, len(ids), graph=graph)[0]
    rejected = [v.variant for v in verdicts if not v.passed]
    for v in verdicts:
        per_variant[v.variant]["verdict"] = "accepted" if v.passed else "rejected"
        if not v.passed:
            per_variant[v.variant]["rejected_because"] = v.message()
    # NOTE: the quantised variants are each made from the fp32 graph: their step is from ONNX fp32, not
    # from the variant listed before them; the ORT graphs are each made from the consolidated weights.
    rows = quality.chain_rows(ids, hops, branches)
    return {"samples": int(len(ids)), "seq_len": int(T), "variants": per_variant, "rejected": rejected,
            "verdicts": verdicts, "chain": rows, "chain_markdown": quality.chain_markdown(rows)}


def quality_markdown(qr: dict[str, Any]) -> str:
    """Per-variant quality table (vs torch fp32 on validation text) and the parity chain."""
    lines = [f"Quality on {qr['samples']} validation sequences of {qr['seq_len']} tokens, against torch fp32:", "",
             "| variant | perplexity | ppl increase | KL | top-1 | greedy token agreement | verdict |",
             "|---|--:|--:|--:|--:|--:|---|"]
    for name, r in qr["variants"].items():
        cont = r.get("continuation", {})
        agree = f"{cont['token_agreement']:.3f}" if "token_agreement" in cont else "-"
        shown = f"{name} (ORT-optimised graph)" if r.get("graph") else name
        lines.append(f"| {shown} | {r['ppl']:.3f} | {100 * r['ppl_increase']:+.3f}% | {r['kl']:.2e} | "
                     f"{r['top1']:.4f} | {agree} | {r.get('verdict', '-')} |")
        if "portable" in r:
            p = r["portable"]
            lines.append(f"| {name} (portable graphs) | {p['ppl']:.3f} | {100 * p['ppl_increase']:+.3f}% | "
                         f"{p['kl']:.2e} | {p['top1']:.4f} | - | {r.get('verdict', '-')} |")
    why = [f"- {r['rejected_because']}" for r in qr["variants"].values() if "rejected_because" in r]
    if why:
        lines += ["", "Rejected (kept here with their numbers; not served, promoted or evaluated):", "", *why]
    return "\n".join(lines) + "\n\nParity chain:\n\n" + qr["chain_markdown"]
