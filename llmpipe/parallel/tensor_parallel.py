"""Tensor parallel over the "tp" dimension of the dp x tp x pp mesh, and local-shard accounting.

The plan itself (which Linear is split which way) is model-specific and lives in
llmpipe.models.llama.parallelize.apply_tp; this module checks the degree and picks the sub-mesh.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from llmpipe.models.llama.parallelize import apply_tp
from llmpipe.parallel.mesh import check_tp


def apply(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Apply the LLaMA TP plan on `mesh["tp"]` (a no-op when tp = 1)."""
    tp_mesh = mesh["tp"]
    if tp_mesh.size() == 1:
        return model
    check_tp(tp_mesh.size(), model.args)
    return apply_tp(model, tp_mesh, sequence_parallel)


def local_numel(model: nn.Module) -> int:
    """Parameters this rank holds: a DTensor counts its local shard, a plain tensor all of it."""
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def replicated_numel(model: nn.Module) -> int:
    """Parameters held whole on every tp rank (the norms): plain tensors or DTensors with no Shard placement."""
    return sum(p.numel() for p in model.parameters()
               if not isinstance(p, DTensor) or all(pl.is_replicate() for pl in p.placements))
