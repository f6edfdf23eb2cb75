"""Pure statistics for benchmarks: latency percentiles, throughput, logit agreement.

No timing and no I/O here, so everything is unit-testable with known numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def latency_stats(seconds: Sequence[float]) -> dict[str, float]:
    """Per-call durations in seconds -> p50/p90/p99/mean/std/min/max in milliseconds, plus n.

    Percentiles interpolate linearly between samples (numpy's default); std is the population
    standard deviation, so a single sample gives 0 rather than NaN.
    """
    if len(seconds) == 0:
        raise ValueError("latency_stats needs at least one duration")
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    if not np.all(np.isfinite(ms)) or np.any(ms < 0):
        raise ValueError("durations must be finite and non-negative")
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "p50": float(p50), "p90": float(p90), "p99": float(p99),
        "mean": float(ms.mean()), "std": float(ms.std()),
        "min": float(ms.min()), "max": float(ms.max()), "n": int(ms.size),
    }


def throughput(batch: int, seq: int, latency_ms: float) -> dict[str, float]:
    """Sequences/s and tokens/s (batch * seq tokens per call) at a per-call latency in ms."""
    if latency_ms <= 0:
        raise ValueError(f"latency must be positive, got {latency_ms} ms")
    per_s = 1e3 / latency_ms
    return {"sequences_per_s": batch * per_s, "tokens_per_s": batch * seq * per_s}


def speedup(baseline_ms: float, latency_ms: float) -> float:
    """How many times faster than the baseline: baseline / latency (> 1 is faster)."""
    if latency_ms <= 0:
        raise ValueError(f"latency must be positive, got {latency_ms} ms")
    return baseline_ms / latency_ms


def logit_agreement(reference: np.ndarray, candidate: np.ndarray) -> dict[str, float]:
    """Compare logits (..., vocab): max and mean abs difference, and top-1 agreement, the fraction
    of positions whose argmax over the vocabulary is the same in both."""
    if reference.shape != candidate.shape:
        raise ValueError(f"logit shapes differ: {reference.shape} vs {candidate.shape}")
    ref = reference.astype(np.float64, copy=False)
    diff = np.abs(ref - candidate.astype(np.float64, copy=False))
    top1 = reference.argmax(axis=-1) == candidate.argmax(axis=-1)  # (...,) over positions
    return {
        "max_abs_diff": float(diff.max()),
        "mean_abs_diff": float(diff.mean()),
        "top1_agreement": float(top1.mean()),
    }
