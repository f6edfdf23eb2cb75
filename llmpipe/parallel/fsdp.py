"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer
states sharded over the data-parallel ranks; checkpoints through torch.distributed.checkpoint.

A checkpoint folder (format "dcp") holds `dcp/` (DCP's .metadata plus one .distcp file per rank,
with {"model": ..., "optim": ...} under llmpipe's plain parameter names) and trainer_state.pt
(step, data position, RNG, scheduler and loss scaler; written by rank 0). A DCP checkpoint can be
resumed on a different world size; llmpipe.checkpoint.dcp consolidates it into one safetensors.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from llmpipe.parallel.base import TorchOptimizerStrategy
from llmpipe.parallel.compose import compose


def dp_mesh(device: torch.device, world: int) -> DeviceMesh:
    """A 1-D mesh over every rank, named "dp"."""
    return init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank holds for `t` (the local shard of a DTensor)."""
    if t is None:
        return 0
    t = t.to_local() if isinstance(t, DTensor) else t
    return t.numel() * t.element_size()


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Model-state bytes on this rank from the local shards (plain tensors count whole, so DDP works
    too): parameters, gradients (one per trainable parameter, its size: what the reduce-scatter
    leaves) and optimizer states. NOTE: while accumulating without sync, FSDP2 also holds
    unsharded fp32 gradients (full size) until the last micro-step; they are not counted here."""
    params = list(model.parameters())
    states = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    out = {"params": sum(local_bytes(p) for p in params),
           "grads": sum(local_bytes(p) for p in params if p.requires_grad),
           "optimizer": sum(local_bytes(v) for v in states)}
    out["total"] = sum(out.values())
    return out


class FSDPStrategy(TorchOptimizerStrategy):
    """FSDP2 over a 1-D mesh; mixed precision by policy (no autocast); GradScaler for fp16."""

    format, state_format = "dcp", "dcp-nested"

    def __init__(self, cfg, env, args):
        if not torch.distributed.is_initialized():
            raise ValueError("train.parallel.data=fsdp needs a process group: launch with torchrun "
                             "(train.nproc_per_node >= 1), not in-process")
        self.cfg, self.env = cfg, env
        self.mesh = dp_mesh(env.device, env.world)
        # built on meta, sharded, then each rank allocates and initialises only its shards; gradients
        # are fp32 (the sharded parameters' dtype), which the fp16 scaler unscales
        c = compose(cfg, env, args, mesh=self.mesh, data="fsdp")
        self.parts, self.opts, self.scheds, self.scaler = c.parts, c.optimizers, c.schedulers, c.scaler
        self.module = self.parts[0]
        self.accum, self.max_grad_norm = cfg.train.grad_accum_steps, cfg.train.optim.clip_grad_norm

    def micro_context(self, sync: bool):
        # NOTE: without sync FSDP2 keeps unsharded gradients until the last micro-step's
        # reduce-scatter: less communication, but full-size gradients per rank while accumulating.
        self.module.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def grad_norm(self) -> torch.Tensor:
        norm = super().grad_norm()
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # partial over the shards: reduce

    def memory_stats(self) -> dict[str, int]:
        return model_state_bytes(self.module, self.opts[0])

    def close(self) -> None:
        del self.module, self.parts, self.opts, self.scheds, self.mesh
