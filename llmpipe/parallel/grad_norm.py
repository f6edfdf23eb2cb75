"""The global gradient norm and clipping over sharded gradients (TP, FSDP2 and pipeline stages)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor


def total_grad_norm(params: list[nn.Parameter], pp_group=None) -> torch.Tensor:
    """The global gradient norm over every rank's shards.

    Squared norms are summed locally per (mesh, sharded dims), all-reduced over the mesh dimensions
    each gradient is sharded on (TP shards, FSDP shards; replicas are counted once), then over the
    pipeline ranks, which hold disjoint stages.
    """
    sums: dict[tuple, torch.Tensor] = {}
    meshes: dict[tuple, Any] = {}
    device = torch.device("cpu")
    for p in params:
        g = p.grad
        if g is None:
            continue
        key: tuple = ()
        if isinstance(g, DTensor):
            dims = tuple(i for i, pl in enumerate(g.placements) if pl.is_shard())
            key = (id(g.device_mesh), dims)
            meshes[key] = g.device_mesh
            g = g.to_local()
        device = g.device
        sq = g.detach().float().pow(2).sum()
        sums[key] = sums[key] + sq if key in sums else sq
    total = torch.zeros((), device=device, dtype=torch.float32)
    for key, value in sums.items():
        for d in key[1] if key else ():
            dist.all_reduce(value, group=meshes[key].get_group(d))
        total = total + value
    if pp_group is not None:
        dist.all_reduce(total, group=pp_group)
    return total.sqrt()


def clip_(params: list[nn.Parameter], norm: torch.Tensor, max_norm: float | None) -> None:
    """Scale every local gradient shard by min(1, max_norm / norm)."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params if p.grad is not None]
    if max_norm and grads:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
