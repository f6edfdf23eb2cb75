"""The optimizer and learning-rate schedule, built once for every layout (llmpipe.parallel and
llmpipe.train both use this module; it imports neither).

AdamW with decoupled weight decay on matrices only (not on norms). Learning-rate schedule: linear
warm-up, then cosine / linear / constant / wsd decay to min_lr_ratio.

wsd (warmup-stable-decay) holds the peak lr until the last `decay_fraction` of the steps, then decays
linearly. A checkpoint from the stable phase is where a longer run branches off: continuing it with a
larger max_steps gives exactly the run that had planned the larger max_steps from the start.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llmpipe import device as dev


def decay_start(total: int, warmup: int, decay_fraction: float) -> int:
    """wsd: the first optimizer step (0-based) whose lr is below the peak."""
    return max(warmup, total - math.ceil(decay_fraction * total))


def lr_factor(step: int, warmup: int, total: int, decay: str, min_ratio: float, decay_fraction: float = 0.2) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based)."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if decay == "constant" or total <= warmup:
        return 1.0
    if decay == "wsd":
        start = decay_start(total, warmup, decay_fraction)
        if step < start:
            return 1.0  # exactly: the stable phase must not depend on total
        return min_ratio + (1.0 - min_ratio) * (1.0 - (step - start + 1) / max(1, total - start))
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * shape


def schedule_factor(cfg):
    """lr_factor bound to this config: the function every strategy's LambdaLR uses."""
    s, total, warmup = cfg.train.schedule, cfg.train.max_steps, warmup_steps(cfg)
    return lambda step: lr_factor(step, warmup, total, s.decay, s.min_lr_ratio, s.decay_fraction)


def stable_until(cfg) -> int | None:
    """wsd: the last checkpoint step still in the stable phase (every update before it at the peak
    lr or in warm-up); None for other decays."""
    s = cfg.train.schedule
    return decay_start(cfg.train.max_steps, warmup_steps(cfg), s.decay_fraction) if s.decay == "wsd" else None


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


def global_batch(cfg, world: int) -> int:
    """Sequences per optimizer step: micro_batch_size x grad_accum_steps x data-parallel replicas."""
    t, p = cfg.train, cfg.train.parallel
    return t.micro_batch_size * t.grad_accum_steps * (p.dp or data_parallel_size(cfg, world))



def _groups(model: nn.Module) -> dict[tuple, list[tuple[str, nn.Parameter]]]:
    """(decays, DTensor mesh) -> [(name, parameter)], in order of first appearance; trainable
    parameters only (LoRA's frozen base has no optimizer state)."""
    groups: dict[tuple, list[tuple[str, nn.Parameter]]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        mesh = p.device_mesh.mesh_dim_names if isinstance(p, DTensor) else None
        shape = getattr(p, "ds_shape", p.shape)  # a ZeRO-3 partitioned parameter's own shape
        groups.setdefault((len(shape) >= 2, mesh), []).append((name, p))
    return groups


def param_order(model: nn.Module) -> list[str]:
    """Parameter names in the order build_optimizer's optimizer numbers them (its state_dict's ids)."""
    return [name.replace("_checkpoint_wrapped_module.", "") for ps in _groups(model).values() for name, _ in ps]


def build_optimizer(model: nn.Module, cfg, world: int | None = None):
    """AdamW over `model`'s parameters (decay on matrices only) and its LambdaLR schedule (peak lr
    scaled by the global batch and warm-up in micro-batches when the config asks). Parameters are
    grouped by DTensor mesh as well, since foreach kernels take one mesh per call; groups come in the
    order their first parameter appears (matrices first in a LLaMA block). The implementation is
    llmpipe.device.fused_adamw's choice, fused or foreach: the same update either way, within rounding."""
    o = cfg.train.optim
    if world is None:
        world = dist.get_world_size() if dist.is_initialized() else 1
    groups = _groups(model)
    impl = "fused" if dev.fused_adamw({p.device.type for ps in groups.values() for _, p in ps}) else "foreach"
    opt = torch.optim.AdamW([{"params": [p for _, p in ps], "weight_decay": o.weight_decay if decay else 0.0}
                             for (decay, _), ps in groups.items()],
                            lr=peak_lr(cfg, world), betas=tuple(o.betas), eps=o.eps, **{impl: True})
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, schedule_factor(cfg))
