"""Quality on validation text: perplexity, agreement with a reference, gates, the parity chain.

Every variant (torch, ORT fp32/fp16/int8, OM) scores the same fixed, seeded sample of validation
sequences; its logits are compared with a reference's (torch fp32) as perplexity, KL and top-1
agreement, and judged against the variant's limits (benchmark.quality.<variant>). The parity chain
follows one model down the pipeline (training checkpoint -> consolidated weights -> ONNX -> OM)
and names the hop where the numbers move most.

Pure numpy except `val_sample` (reads a shard) and `checkpoint_logits_model` (reads a checkpoint).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from llmpipe.checkpoint import io as ckpt
from llmpipe.checkpoint import portable
from llmpipe.config import GateSection, QualitySection
from llmpipe.data.shards import TokenShard
from llmpipe.models.llama import io as model_io
from llmpipe.models.llama.lora import LoraSpec, merged
from llmpipe.models.llama.model import Transformer
from llmpipe.stages import StageError

# gate field -> (metric in text_metrics, words in the message, True when the value must stay below)
_LIMITS = {"max_ppl_increase": ("ppl_increase", "perplexity", True),
           "min_top1": ("top1", "top-1 agreement", False),
           "max_kl": ("kl", "KL", True)}


# ---- the validation sample ------------------------------------------------------------------

def val_sample(val_bin: Path, n: int, seq_len: int, seed: int) -> np.ndarray:
    """(min(n, available), seq_len) int64: distinct windows of seq_len tokens from the validation
    shard, chosen with `seed` and returned in stream order, so the same arguments give the same array.

    Windows are the shard's own samples for seq_len - 1 (`TokenShard.sample`), whose seq_len tokens
    are exactly what the model sees: position t predicts token t + 1, seq_len - 1 predictions each.
    """
    shard = TokenShard(val_bin)
    available = shard.num_samples(seq_len - 1)
    if available == 0:
        raise StageError(f"benchmark.quality: the validation shard {val_bin} holds {shard.n_tokens} tokens, "
                         f"fewer than one sequence of {seq_len}; lower benchmark.quality.seq_len")
    rng = np.random.default_rng(seed)
    picked = np.sort(rng.choice(available, size=min(n, available), replace=False))
    return np.stack([shard.sample(int(i), seq_len - 1) for i in picked])  # (n', seq_len)


# ---- scores on known logits -----------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis, in float64, stable for large logits."""
    x = x.astype(np.float64, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _check(ids: np.ndarray, *logits: np.ndarray) -> None:
    if ids.ndim != 2 or ids.shape[1] < 2:
        raise ValueError(f"ids must be (N, T) with T >= 2, got {ids.shape}")
    for x in logits:
        if x.shape[:2] != ids.shape or x.ndim != 3:
            raise ValueError(f"logits must be (N, T, V) over ids {ids.shape}, got {x.shape}")


def _nll(ids_row: np.ndarray, logp: np.ndarray) -> float:
    """Summed negative log-likelihood of ids_row[1:] under logp[:-1] (T, V)."""
    return float(-logp[np.arange(len(ids_row) - 1), ids_row[1:]].sum())


def perplexity(ids: np.ndarray, logits: np.ndarray) -> float:
    """exp of the mean next-token negative log-likelihood: logits[:, t] predicts ids[:, t + 1]."""
    _check(ids, logits)
    # NOTE: one sequence at a time: (N, T, V) in float64 is gigabytes at a real vocabulary.
    nll = sum(_nll(ids[i], _log_softmax(logits[i])) for i in range(len(ids)))
    return math.exp(nll / (ids.shape[0] * (ids.shape[1] - 1)))


def text_metrics(ids: np.ndarray, ref_logits: np.ndarray, logits: np.ndarray) -> dict[str, float]:
    """`logits` against `ref_logits` on the same ids (N, T): perplexity of each, the relative increase,
    mean KL(ref || candidate) and top-1 agreement over all N x T positions, the largest logit difference.

    Perplexity scores the N x (T - 1) positions that have a next token; the comparisons use every
    position, the last one's distribution included.
    """
    _check(ids, ref_logits, logits)
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} vs {logits.shape}")
    nll_ref = nll = kl = agree = max_diff = 0.0
    for i in range(len(ids)):  # one sequence at a time, as in perplexity
        ref, cand = _log_softmax(ref_logits[i]), _log_softmax(logits[i])  # (T, V)
        nll_ref += _nll(ids[i], ref)
        nll += _nll(ids[i], cand)
        kl += float((np.exp(ref) * (ref - cand)).sum())
        agree += float((ref_logits[i].argmax(-1) == logits[i].argmax(-1)).sum())
        diff = np.abs(ref_logits[i].astype(np.float64) - logits[i].astype(np.float64))
        max_diff = max(max_diff, float(diff.max()))
    n, t = ids.shape
    ppl_ref, ppl = math.exp(nll_ref / (n * (t - 1))), math.exp(nll / (n * (t - 1)))
    return {"ppl": ppl, "ppl_ref": ppl_ref, "ppl_increase": ppl / ppl_ref - 1, "kl": kl / (n * t),
            "top1": agree / (n * t), "max_abs_diff": max_diff}


def continuation_agreement(ref_tokens: np.ndarray, tokens: np.ndarray) -> dict[str, float]:
    """Greedy continuations (N, K) against the reference's: the fraction of equal tokens, the mean
    common prefix as a fraction of K, and the fraction of rows identical throughout."""
    ref_tokens, tokens = np.asarray(ref_tokens), np.asarray(tokens)
    if ref_tokens.shape != tokens.shape or ref_tokens.ndim != 2 or ref_tokens.size == 0:
        raise ValueError(f"continuations must be two non-empty (N, K) arrays, got {ref_tokens.shape} "
                         f"and {tokens.shape}")
    same = ref_tokens == tokens  # (N, K)
    prefix = np.cumprod(same, axis=1).sum(axis=1)  # (N,) equal tokens before the first difference
    return {"token_agreement": float(same.mean()), "prefix_match": float(prefix.mean() / same.shape[1]),
            "identical": float(same.all(axis=1).mean())}


# ---- gates ----------------------------------------------------------------------------------

@dataclass
class Verdict:
    """A variant's quality gate: passed, or the first limit it broke (the metric, its value, the limit)."""
    variant: str
    passed: bool
    metric: str | None = None  # the gate field: "max_ppl_increase" or "min_top1"
    value: float | None = None
    limit: float | None = None
    sequences: int | None = None  # validation sequences the value was measured on
    graph: str | None = None  # which of the variant's graphs, when it has more than one (ORT-optimised, portable)

    def reason(self) -> str:
        """What broke, by how much, and the field: `int8: top-1 agreement 0.8500 < benchmark.quality.int8.min_top1=0.9
        on 16 validation sequences`."""
        _, words, upper = _LIMITS[self.metric]
        shown = f"{self.value:+.2%}" if self.metric == "max_ppl_increase" else f"{self.value:.4f}"
        op = (">" if upper else "<") if math.isfinite(self.value) else "is not finite, limit"
        on = f" on {self.sequences} validation sequences" if self.sequences is not None else ""
        which = f" ({self.graph})" if self.graph else ""
        return (f"{self.variant}{which}: {words} {shown} {op} benchmark.quality.{self.variant}.{self.metric}="
                f"{self.limit:g}{on}")

    def message(self) -> str:
        """One line for a failure: what broke, by how much, and the field to change."""
        head, rest = self.reason().split(": ", 1)
        return f"benchmark: {head} fails its quality gate: {rest} (rejected: not deployed, its numbers kept)"


def judge(metrics: dict[str, dict[str, float]], quality: QualitySection,
          sequences: int | None = None, graph: str | None = None) -> list[Verdict]:
    """One Verdict per variant of `metrics` (name -> text_metrics), in order, against its section of
    `quality`; a variant without one (torch) passes. A non-finite value (NaN logits) fails any limit.
    `graph`: which of the variants' graphs these metrics are of (named in a failure's message)."""
    verdicts = []
    for variant, m in metrics.items():
        gate = getattr(quality, variant, None)
        verdict = Verdict(variant, True, sequences=sequences, graph=graph)
        if isinstance(gate, GateSection):
            for field, (key, _, upper) in _LIMITS.items():
                limit, value = getattr(gate, field), float(m[key])
                if limit is not None and (not math.isfinite(value) or (value > limit if upper else value < limit)):
                    verdict = Verdict(variant, False, field, value, float(limit), sequences, graph)
                    break
        verdicts.append(verdict)
    return verdicts


def enforce_gates(verdicts: Sequence[Verdict], enforce: bool, required: Sequence[str] = ()) -> list[str]:
    """The rejected variants' names. With `enforce`, StageError (one line naming EVERY failing variant) when a
    variant of `required` (benchmark.require) failed, or when no variant is left deployable; a rejected
    variant is otherwise recorded, not fatal (it is not served, promoted or evaluated)."""
    failed = [v for v in verdicts if not v.passed]
    must = [v.variant for v in failed if v.variant in required]
    if enforce and failed and (must or len(failed) == len(verdicts)):
        why = (f"required variant{'s' * (len(must) > 1)} {', '.join(must)} (benchmark.require) failed" if must
               else "no variant is left deployable")
        raise StageError(f"benchmark: {why}; {len(failed)} of {len(verdicts)} failed their quality gates: "
                         f"{'; '.join(v.reason() for v in failed)} (relax a limit under benchmark.quality, "
                         "or set benchmark.quality.enforce: false)")
    return [v.variant for v in failed]


# ---- the parity chain -----------------------------------------------------------------------

def _pair(ids: np.ndarray, ref: np.ndarray, cand: np.ndarray) -> dict[str, float]:
    m = text_metrics(ids, ref, cand)
    return {"max_abs_diff": m["max_abs_diff"], "kl": m["kl"], "top1": m["top1"]}


def chain_rows(ids: np.ndarray, hops: Sequence[tuple[str, np.ndarray | None, str | None]],
               branches: dict[str, str] | None = None) -> list[dict]:
    """One row per hop (name, logits or None, why not measured), in order. A measured row has its
    perplexity, max_abs_diff/kl/top1 against the first measured hop (the reference) and
    prev/prev_max_abs_diff/prev_kl against the previous measured one; the row with the largest
    prev_kl (a non-finite one counts as largest) has "moved": True, every other False.

    `branches`: hop name -> the hop it branches from (a variant made from that graph, e.g. int4 from
    ONNX fp32): its prev is that hop, and the hops after it continue from the main line."""
    rows, ref, prev, seen = [], None, None, {}
    branches = branches or {}
    for name, logits, reason in hops:
        row = {"name": name, "reason": reason, "ppl": None, "max_abs_diff": None, "kl": None, "top1": None,
               "prev": None, "prev_max_abs_diff": None, "prev_kl": None, "moved": False}
        if logits is not None:
            ref = logits if ref is None else ref
            row.update(ppl=perplexity(ids, logits), reason=None, **_pair(ids, ref, logits))
            base = (branches[name], seen[branches[name]]) if branches.get(name) in seen else prev
            if base is not None:
                step = _pair(ids, base[1], logits)
                row.update(prev=base[0], prev_max_abs_diff=step["max_abs_diff"], prev_kl=step["kl"])
            seen[name] = logits
            if name not in branches:
                prev = (name, logits)
        rows.append(row)
    steps = [r for r in rows if r["prev_kl"] is not None]
    if steps:
        max(steps, key=lambda r: r["prev_kl"] if math.isfinite(r["prev_kl"]) else math.inf)["moved"] = True
    return rows


def _num(x: float | None, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def chain_markdown(rows: Sequence[dict]) -> str:
    """The chain as a markdown table, then a sentence naming the hop where the numbers move most."""
    lines = ["| hop | perplexity | max abs diff vs ref | KL vs ref | top-1 vs ref | max abs diff vs previous "
             "| KL vs previous |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        name = f"**{r['name']}**" if r["moved"] else r["name"]
        if r["ppl"] is None:
            lines.append(f"| {name} | not measured: {r['reason'] or 'no logits'} | | | | | |")
            continue
        lines.append(f"| {name} | {r['ppl']:.4f} | {r['max_abs_diff']:.3g} | {r['kl']:.3g} | {r['top1']:.4f} "
                     f"| {_num(r['prev_max_abs_diff'], '.3g')} | {_num(r['prev_kl'], '.3g')} |")
    moved = [r for r in rows if r["moved"]]
    if moved:
        r = moved[0]
        lines += ["", f"The largest step is {r['name']}: KL {r['prev_kl']:.3g} vs {r['prev']} "
                      f"(max abs logit diff {r['prev_max_abs_diff']:.3g})."]
    else:
        lines += ["", "Fewer than two hops were measured: no step to compare."]
    return "\n".join(lines) + "\n"


# ---- the training checkpoint as a model -----------------------------------------------------

def checkpoint_logits_model(train_dir: Path) -> Transformer:
    """The newest verified checkpoint under `<train_dir>/checkpoints/`, any format, as an fp32 CPU
    Transformer in eval mode; its architecture from the train stage's model_config.json."""
    folder = ckpt.latest_valid(Path(train_dir) / "checkpoints")
    if folder is None:
        raise StageError(f"benchmark.quality: no verified training checkpoint in {Path(train_dir) / 'checkpoints'}")
    try:
        args = model_io.read_args(train_dir)
        # NOTE: the weights only (DCP and ZeRO shards assembled into full tensors); ZeRO's reader
        # also rebuilds the optimizer moments, which it stores interleaved with the weights.
        state = portable.read_model(folder)
        spec = LoraSpec.of(ckpt.read_meta(folder).get("lora"))
        if spec is not None:  # LoRA: the adapters merged into their weights, as consolidate writes them
            names, load = merged({k: tuple(v.shape) for k, v in state.items()}, state.__getitem__, spec.scale)
            state = {n: load(n) for n in names}
    except (ValueError, KeyError, OSError) as err:  # a checkpoint is an input: never a traceback
        raise StageError(f"benchmark.quality: cannot read the training checkpoint {folder}: {err}") from None
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    model.init_weights()  # fills the RoPE buffers; every parameter is overwritten below
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
    return model.float().eval()
