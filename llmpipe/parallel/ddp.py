"""Data parallel with torch DDP, configured from train.parallel."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def apply_ddp(model: nn.Module, device: torch.device, parallel) -> DDP:
    """Wrap `model` in DDP. Parameters are broadcast from rank 0 at construction."""
    return DDP(
        model,
        device_ids=None if device.type == "cpu" else [device.index],
        bucket_cap_mb=parallel.bucket_cap_mb,
        gradient_as_bucket_view=parallel.gradient_as_bucket_view,
        static_graph=parallel.static_graph,
        broadcast_buffers=parallel.broadcast_buffers,
    )
