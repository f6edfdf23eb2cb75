"""The generation benchmark: time to first token, time per output token and decode throughput of
every engine (PyTorch eager with its KV cache as the baseline, onnxruntime fp32/fp16/int8 with the
static decoder, the OM models through ais_bench), and one generated sample per engine.

The definitions (also written into results.md) are those of llmpipe.infer.decode:

- prefill latency: the prompt pass alone (batch 1), ms;
- TTFT: from the call to the first new token picked (prompt pass + picking), ms;
- TPOT: the mean time of each token after the first, ms; decode tokens/s = batch * (n - 1) / the
  time after the first token; end-to-end tokens/s = batch * n / the whole call.

Every measurement is one untimed warm-up call then `repeats` timed calls on fixed prompts (random
token ids: timing does not depend on the text, and no row stops early at an end-of-text token).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llmpipe.export.onnx import random_ids
from llmpipe.infer.decode import CapacityError, Generation, generate
from llmpipe.infer.stats import latency_stats

log = logging.getLogger("llmpipe.bench")

DEFINITIONS = [
    "prefill: the prompt pass alone at batch 1 (ms).",
    "TTFT (time to first token): from the call to the first new token picked, i.e. the prompt pass plus "
    "picking one token (ms), batch 1.",
    "TPOT (time per output token): the mean time of each token after the first, (end - first token) / "
    "(n - 1) (ms); one decode step serves the whole batch.",
    "decode tokens/s: batch * (n - 1) / (end - first token), the first token excluded; end-to-end "
    "tokens/s: batch * n / (end - start), the prompt pass included.",
    "Each figure: the median of the timed repetitions, after one untimed warm-up; prompts are fixed "
    "random token ids, greedy picking, no early stop.",
]


@dataclass(frozen=True)
class LlmPlan:
    prompt_lens: Sequence[int]
    batches: Sequence[int]
    decode_prompt_len: int
    new_tokens: int
    repeats: int
    vocab_size: int
    seed: int = 0


def _runs(engine, ids: np.ndarray, new_tokens: int, repeats: int) -> list[Generation]:
    generate(engine, ids, min(new_tokens, 2))  # warm-up (allocations, first-call setup)
    return [generate(engine, ids, new_tokens) for _ in range(repeats)]


def _median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def measure_prefill(engine, plan: LlmPlan) -> list[dict[str, Any]]:
    """Prefill latency and TTFT at batch 1 for each prompt length."""
    rows = []
    for i, length in enumerate(plan.prompt_lens):
        row: dict[str, Any] = {"batch": 1, "prompt_len": length, "prefill_ms": None, "ttft_ms": None,
                               "error": None}
        try:
            gens = _runs(engine, random_ids(1, length, plan.vocab_size, plan.seed + i), 1, plan.repeats)
        except CapacityError as err:
            row["error"] = str(err)
        else:
            row["prefill_ms"] = latency_stats([g.prefill_s for g in gens])["p50"]
            row["ttft_ms"] = latency_stats([g.ttft_s for g in gens])["p50"]
        rows.append(row)
    return rows


def measure_decode(engine, plan: LlmPlan) -> list[dict[str, Any]]:
    """TPOT and decode / end-to-end tokens/s for each batch size (prompt decode_prompt_len)."""
    rows = []
    for batch in plan.batches:
        row: dict[str, Any] = {"batch": batch, "prompt_len": plan.decode_prompt_len,
                               "new_tokens": plan.new_tokens, "tpot_ms": None, "decode_tokens_per_s": None,
                               "e2e_tokens_per_s": None, "ttft_ms": None, "error": None}
        ids = random_ids(batch, plan.decode_prompt_len, plan.vocab_size, plan.seed + 1000 + batch)
        try:
            gens = _runs(engine, ids, plan.new_tokens, plan.repeats)
        except CapacityError as err:
            row["error"] = str(err)
        else:
            row["tpot_ms"] = _median([g.tpot_s() * 1e3 for g in gens])
            row["decode_tokens_per_s"] = _median([g.decode_tokens_per_s() for g in gens])
            row["e2e_tokens_per_s"] = _median([g.e2e_tokens_per_s() for g in gens])
            row["ttft_ms"] = _median([g.ttft_s * 1e3 for g in gens])
        rows.append(row)
    return rows


def sample_text(engine, tokenizer, prompt: str, n: int, stop_ids: Sequence[int] = (),
                stop_strings: Sequence[str] = ()) -> dict[str, Any]:
    """A greedy continuation of `prompt` (the report shows one per engine). A chat run's prompt is a
    rendered conversation: the answer stops at a stop token (not shown) or before a stop string."""
    ids = tokenizer.encode(prompt).ids
    n = max(1, min(n, engine.capacity + 1 - len(ids)))
    gen = generate(engine, np.array([ids], dtype=np.int64), n, stop_id=list(stop_ids))
    tokens = gen.tokens[0].tolist()
    text = tokenizer.decode([t for t in tokens if t not in stop_ids])
    cuts = [i for i in (text.find(s) for s in stop_strings if s) if i >= 0]
    out = {"prompt": prompt, "tokens": tokens, "text": text[:min(cuts)] if cuts else text}
    return {**out, "chat": True} if stop_ids or stop_strings else out


def measure_engine(name: str, provider: str, open_engine: Callable[[], Any], plan: LlmPlan,
                   tokenizer=None, sample: tuple | None = None) -> dict[str, Any]:
    """Every measurement of one engine; a failure to open or run it is recorded, not raised."""
    out: dict[str, Any] = {"variant": name, "provider": provider, "prefill": [], "decode": [], "sample": None,
                           "error": None}
    try:
        engine = open_engine()
        out["prefill"] = measure_prefill(engine, plan)
        out["decode"] = measure_decode(engine, plan)
        if tokenizer is not None and sample is not None:
            out["sample"] = sample_text(engine, tokenizer, *sample)
    except Exception as err:  # an engine that cannot run here is a result
        text = str(err).strip().splitlines()[0] if str(err).strip() else ""
        out["error"] = f"{type(err).__name__}: {text}"
        log.warning("llm benchmark %s %s: %s", provider, name, out["error"])
        return out
    for r in out["decode"]:
        if r["tpot_ms"] is not None:
            log.info("llm %s %s batch %d: TPOT %.2f ms, %.0f decode tokens/s, TTFT %.1f ms", provider, name,
                     r["batch"], r["tpot_ms"], r["decode_tokens_per_s"], r["ttft_ms"])
    return out


def flat_rows(measured: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """The prefill or decode rows of every engine, each with its variant, provider and error."""
    rows = []
    for m in measured:
        if m["error"]:  # the engine did not open or run: one row for all its measurements
            rows.append({"variant": m["variant"], "provider": m["provider"], "error": m["error"],
                         "engine_failed": True})
            continue
        rows += [{"variant": m["variant"], "provider": m["provider"], **r} for r in m[kind]]
    return rows


def failed_everywhere(llm: dict[str, Any], prompt_lens: Sequence[int], batches: Sequence[int]) -> str | None:
    """The first measurement no engine made, or None: a prompt length whose TTFT, or a batch whose TPOT,
    is an error on every engine that was tried (the stage fails on it instead of completing with a
    table of errors). Rows that only say why an engine was not tried (no OM model here) do not count."""
    for kind, key, values, figure, what in (("prefill", "prompt_len", prompt_lens, "ttft_ms", "TTFT at prompt length"),
                                            ("decode", "batch", batches, "tpot_ms", "TPOT at batch")):
        failed = [r for r in llm[kind] if r.get("engine_failed")]
        for value in values:
            rows = [r for r in llm[kind] if r.get(key) == value] + failed
            if rows and all(r.get(figure) is None for r in rows):
                field = "prompt_lens" if key == "prompt_len" else "batches"
                first = next(r for r in rows if r.get("error"))
                return (f"benchmark.llm.{field}: {what} {value} failed on every engine ({len(rows)} tried; "
                        f"{first['provider']}/{first['variant']}: {first['error']})")
    return None


def add_ratios(decode: list[dict], prefill: list[dict], baseline: str = "torch") -> None:
    """decode_speedup = decode tokens/s / the baseline's, ttft_ratio = TTFT / the baseline's, per
    provider and shape."""
    base_d = {(r["provider"], r["batch"]): r.get("decode_tokens_per_s") for r in decode if r["variant"] == baseline}
    base_p = {(r["provider"], r["prompt_len"]): r.get("ttft_ms") for r in prefill if r["variant"] == baseline}
    for r in decode:
        b = base_d.get((r["provider"], r.get("batch")))
        r["decode_speedup"] = r["decode_tokens_per_s"] / b if b and r.get("decode_tokens_per_s") else None
    for r in prefill:
        b = base_p.get((r["provider"], r.get("prompt_len")))
        r["ttft_ratio"] = r["ttft_ms"] / b if b and r.get("ttft_ms") else None


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(llm: dict[str, Any]) -> str:
    """Tables: TTFT by prompt length, TPOT and decode tokens/s by batch; then the definitions."""
    lines = ["| provider | variant | prompt | prefill ms | TTFT ms | TTFT / torch |", "|---|---|--:|--:|--:|--:|"]
    for r in llm["prefill"]:
        if r.get("error"):
            lines.append(f"| {r['provider']} | {r['variant']} | {r.get('prompt_len', '-')} | "
                         f"{r['error'][:100].replace('|', '/')} | - | - |")
            continue
        lines.append(f"| {r['provider']} | {r['variant']} | {r['prompt_len']} | {_f(r['prefill_ms'], '.2f')} | "
                     f"{_f(r['ttft_ms'], '.2f')} | {_f(r.get('ttft_ratio'), '.2f')} |")
    lines += ["", "| provider | variant | batch | TPOT ms | decode tokens/s | vs torch | end-to-end tokens/s |",
              "|---|---|--:|--:|--:|--:|--:|"]
    for r in llm["decode"]:
        if r.get("error"):
            lines.append(f"| {r['provider']} | {r['variant']} | {r.get('batch', '-')} | "
                         f"{r['error'][:100].replace('|', '/')} | - | - | - |")
            continue
        lines.append(f"| {r['provider']} | {r['variant']} | {r['batch']} | {_f(r['tpot_ms'], '.2f')} | "
                     f"{_f(r['decode_tokens_per_s'], ',.0f')} | {_f(r.get('decode_speedup'), '.2f')} | "
                     f"{_f(r['e2e_tokens_per_s'], ',.0f')} |")
    lines += ["", "Definitions:", *(f"- {d}" for d in llm["definitions"])]
    return "\n".join(lines) + "\n"
