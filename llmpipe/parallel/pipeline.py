"""Pipeline parallel: cut the model into stages (torchtitan style) and build torch.distributed.pipelining
schedules (GPipe, 1F1B, interleaved 1F1B).

A stage is the whole Transformer with the other stages' layers deleted, the embedding removed on
every stage but the first and the final norm and head removed on every stage but the last;
`Transformer.forward` skips what is missing, so stage i maps hidden states (B, T, d) to (B, T, d).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from llmpipe.parallel.mesh import LayoutError, check_split_points

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}


def split_layers(n_layers: int, n_stages: int, split_points: list[int] | None = None) -> list[list[int]]:
    """Layer indices of each stage: an even split (the first `n_layers % n_stages` stages take one extra),
    or explicit `split_points` (the first layer of stages 1..n-1)."""
    if n_stages > n_layers:
        raise LayoutError(f"{n_stages} pipeline stages exceed the model's {n_layers} layers")
    if split_points is None:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
        split_points = [sum(sizes[: s + 1]) for s in range(n_stages - 1)]
    check_split_points(split_points, n_layers, n_stages)
    bounds = [0, *split_points, n_layers]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


def stage_ids(pp_rank: int, pp: int, virtual_stages: int = 1) -> list[int]:
    """Stage indices held by a pipeline rank; interleaved ranks hold stages r, r + pp, r + 2 pp, ..."""
    return [pp_rank + v * pp for v in range(virtual_stages)]


def build_stage_module(model: nn.Module, stage_index: int, n_stages: int, layer_ids: list[int]) -> nn.Module:
    """Cut `model` (in place) down to one stage: keep `layer_ids`, the embedding on the first stage,
    the final norm and output head on the last."""
    keep = {str(i) for i in layer_ids}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage_index != 0:
        model.tok_embeddings = None
    if stage_index != n_stages - 1:
        model.norm = None
        model.output = None
    return model


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline of p ranks over m micro-batches: (p-1)/(m+p-1) for GPipe and 1F1B,
    (p-1)/(v*m + p-1) for interleaved 1F1B with v virtual stages per rank."""
    return (p - 1) / (v * m + p - 1)


def make_stages(modules: list[nn.Module], ids: list[int], n_stages: int, device: torch.device,
                group=None) -> list[PipelineStage]:
    """Wrap this rank's stage modules as PipelineStages (shapes are inferred at the first step)."""
    return [PipelineStage(m, i, n_stages, device, group=group) for m, i in zip(modules, ids)]


def make_schedule(name: str, stages: list[PipelineStage], microbatches: int,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, scale_grads: bool = True):
    """A torch.distributed.pipelining schedule over this rank's stage(s); `loss_fn(logits, targets)`.

    `scale_grads=True` divides every gradient by `microbatches` after each step, which is wrong when
    gradients accumulate over several steps (the earlier steps' share would be divided again): the
    training loop passes False and a loss_fn that does the division itself.
    """
    if name not in SCHEDULES:
        raise LayoutError(f"unknown pp_schedule {name!r} (known: {', '.join(SCHEDULES)})")
    if name == "interleaved_1f1b":
        if len(stages) < 2:
            raise LayoutError(f"interleaved_1f1b needs >= 2 stages per rank (got {len(stages)})")
        return ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=loss_fn,
                                       scale_grads=scale_grads)
    if len(stages) != 1:
        raise LayoutError(f"pp_schedule={name} runs one stage per rank (got {len(stages)})")
    return SCHEDULES[name](stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
