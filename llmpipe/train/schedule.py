"""Learning-rate schedule: linear warm-up, then cosine / linear / constant decay to min_lr_ratio."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape
