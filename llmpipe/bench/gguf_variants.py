"""The benchmark's GGUF variants: export_onnx's gguf/ files (export.gguf) run by llama.cpp and judged by the
same gates as the onnxruntime variants.

Each file becomes a variant gguf_<type> (gguf_f16, gguf_q8_0, gguf_q4_0, gguf_q4_1) with a gate of its own in
benchmark.quality. When llama-cpp-python (the optional extra `llamacpp`) is importable, the variant is
scored like the others (perplexity, KL and top-1 against torch fp32 on the same validation windows, its
prompt pass with every position's logits) and its decode tokens/s measured at batch 1 (benchmark.llm's
decode prompt and new tokens, the median of its repeats); without it, each is recorded as skipped with the
reason and nothing fails. With export.gguf_adapter: separate, export_onnx's LoRA GGUF (output lora_gguf) is
applied to the 4-bit files (written from the fine-tune's base), by llama.cpp at run time.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path
from typing import Any

import numpy as np

from llmpipe.bench import quality

PREFIX = "gguf_"


def unavailable_reason() -> str | None:
    """Why llama.cpp cannot run the GGUF variants here, or None."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (pip install 'llmpipe[llamacpp]')"
    return None


class LlamaCppEngine:
    """llama.cpp (llama-cpp-python) behind the engines' start / step / prompt calls, one sequence at a time."""

    def __init__(self, path: Path, threads: int, n_ctx: int, logits_all: bool = False, lora: Path | None = None):
        import llama_cpp

        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=logits_all, verbose=False,
                                   lora_path=str(lora) if lora is not None else None)

    def prompt(self, ids: np.ndarray) -> np.ndarray:
        """Every position's logits (B, T, vocab) of each row of `ids` (B, T), each from an empty cache."""
        out = []
        for row in np.asarray(ids):
            self.llm.reset()
            self.llm.eval(row.tolist())
            out.append(np.array(self.llm.scores[:len(row)], dtype=np.float32))
        return np.stack(out)

    def start(self, ids: np.ndarray) -> np.ndarray:
        if ids.shape[0] != 1:
            raise ValueError(f"llama.cpp's engine here decodes one sequence, got a batch of {ids.shape[0]}")
        self.llm.reset()
        self.llm.eval(ids[0].tolist())
        return self._last()

    def step(self, tokens: np.ndarray) -> np.ndarray:
        self.llm.eval([int(np.asarray(tokens).reshape(-1)[0])])
        return self._last()

    def _last(self) -> np.ndarray:
        return last_logits(self.llm)[None]  # (1, vocab)


def last_logits(llm) -> np.ndarray:
    """The logits of the last token `llm` (a llama_cpp.Llama) evaluated, (vocab,) float32. Read from llama.cpp's
    context: llama-cpp-python (0.3.x) copies logits into `Llama.scores` only when made with logits_all, and
    without it that array holds whatever the allocation held."""
    import llama_cpp

    if getattr(llm, "_logits_all", False):  # what Llama(logits_all=...) was given
        return np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits(llm.ctx), shape=(llm.n_vocab(),)).astype(np.float32)


def files(export_dir: Path, manifest) -> dict[str, Path]:
    """variant name -> its file, for every gguf_<type> export_onnx's manifest (llmpipe.manifest.Manifest) lists
    (resolved inside `export_dir`, as every stage input is)."""
    return {name: manifest.path(export_dir, name) for name in manifest.outputs if name.startswith(PREFIX)}


ADAPTER = "lora_gguf"  # export_onnx's output for export.gguf_adapter: separate (llmpipe.export.onnx)
SEPARATE = ("gguf_q4_0", "gguf_q4_1")  # the files written from the base when it is


def adapter(export_dir: Path, manifest) -> Path | None:
    """export_onnx's LoRA GGUF (export.gguf_adapter: separate), applied to its 4-bit files; None without."""
    return manifest.path(export_dir, ADAPTER) if ADAPTER in manifest.outputs else None


def decode_rate(engine: LlamaCppEngine, prompt: np.ndarray, new: int) -> float:
    """Decode tokens/s at batch 1 after the first token (as llmpipe.infer.decode.generate counts them)."""
    tok = engine.start(prompt).argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new - 1):
        tok = engine.step(tok).argmax(-1)
    return (new - 1) / (time.perf_counter() - t0)


def results(found: dict[str, Path], ids: np.ndarray, ref: np.ndarray, cfg, threads: int, vocab: int,
            seed: int, lora: Path | None = None) -> dict[str, Any]:
    """results["gguf"]: per variant its file's bytes and either why it was skipped or its metrics, verdict
    and decode tokens/s. `ids` (N, T) and `ref` (torch fp32's logits of them) are the quality windows; `cfg`
    benchmark (its quality gates and llm decode settings). The verdicts are returned under "verdicts" for the
    stage to judge with the other variants' (a rejected one is recorded; benchmark.require decides what fails)."""
    reason = unavailable_reason()
    rows: dict[str, dict[str, Any]] = {}
    for name, path in found.items():
        rows[name] = {"file": path.name, "bytes": path.stat().st_size}
        if reason:
            rows[name]["skipped"] = reason
    if reason or not found:
        return {"variants": rows, "rejected": [], "verdicts": []}
    c = cfg.llm
    n_ctx = max(ids.shape[1], c.decode_prompt_len + c.new_tokens) + 8
    prompt = np.random.default_rng(seed).integers(1, vocab, (1, c.decode_prompt_len))
    metrics = {}
    for name, path in found.items():
        extra = lora if name in SEPARATE else None  # `lora`: export.gguf_adapter's file, for the 4-bit bases
        if extra is not None:
            rows[name]["adapter"] = extra.name
        metrics[name] = quality.text_metrics(ids, ref, LlamaCppEngine(path, threads, n_ctx, True, extra).prompt(ids))
        engine = LlamaCppEngine(path, threads, n_ctx, lora=extra)
        decode_rate(engine, prompt, 4)  # warm-up
        rates = [decode_rate(engine, prompt, c.new_tokens) for _ in range(c.repeats)]
        rows[name].update(metrics[name], decode_tokens_per_s=float(np.median(rates)), decode_batch=1)
    verdicts = quality.judge(metrics, cfg.quality, sequences=len(ids))
    rejected = [v.variant for v in verdicts if not v.passed]
    for v in verdicts:
        rows[v.variant]["verdict"] = "accepted" if v.passed else "rejected"
        if not v.passed:
            rows[v.variant]["rejected_because"] = v.message()
    return {"variants": rows, "rejected": rejected, "verdicts": verdicts}


def markdown(g: dict[str, Any] | None) -> str:
    """The GGUF variants' section of results.md ('' when export.gguf wrote none)."""
    if not g or not g["variants"]:
        return ""
    lines = ["\n## GGUF (llama.cpp)\n",
             "| variant | MB | ppl increase | KL | top-1 | decode tok/s (batch 1) | verdict |",
             "|---|--:|--:|--:|--:|--:|---|"]
    for name, r in g["variants"].items():
        if "skipped" in r:
            lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} | - | - | - | - | skipped: {r['skipped']} |")
            continue
        lines.append(f"| {name} | {r['bytes'] / 1e6:.1f} | {100 * r['ppl_increase']:+.2f}% | {r['kl']:.2e} | "
                     f"{r['top1']:.4f} | {r['decode_tokens_per_s']:.1f} | {r['verdict']} |")
        if "adapter" in r:
            lines[-1] = lines[-1].replace(f"| {name} |", f"| {name} (+ {r['adapter']}) |", 1)
    return "\n".join(lines) + "\n"
