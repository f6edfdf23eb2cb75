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


def data_parallel_size(cfg, world: int) -> int:
    """Replicas reading different samples: the world divided by the tensor and pipeline degrees."""
    return max(1, world // (cfg.train.parallel.tp * cfg.train.parallel.pp))


def peak_lr(cfg, world: int) -> float:
    """train.optim.lr, scaled linearly by global batch / lr_reference_batch when that is set."""
    t = cfg.train
    ref = t.optim.lr_reference_batch
    if ref is None:
        return t.optim.lr
    return t.optim.lr * t.micro_batch_size * t.grad_accum_steps * data_parallel_size(cfg, world) / ref


def warmup_steps(cfg) -> int:
    """Warm-up in optimizer steps: as given, or micro-batch steps divided by the accumulation (rounded up)."""
    s = cfg.train.schedule
    if s.warmup_unit == "micro_batches":
        return math.ceil(s.warmup_steps / cfg.train.grad_accum_steps)
    return s.warmup_steps
