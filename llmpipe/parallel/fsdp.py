"""Fully sharded data parallel with FSDP2 (`fully_shard`): parameters, gradients and optimizer
states sharded over the data-parallel ranks; checkpoints through torch.distributed.checkpoint.

A checkpoint folder (format "dcp") holds `dcp/` (DCP's .metadata plus one .distcp file per rank,
with {"model": ..., "optim": ...} under llmpipe's plain parameter names) and trainer_state.pt
(step, data position, RNG, scheduler and loss scaler; written by rank 0). A DCP checkpoint can be
resumed on a different world size; llmpipe.checkpoint.dcp consolidates it into one safetensors.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from llmpipe import device as dev
from llmpipe.checkpoint.dcp import DCP_DIR, save_state
from llmpipe.checkpoint.io import Written
from llmpipe.checkpoint.trust import SafeReader
from llmpipe.optim import build_optimizer
from llmpipe.parallel.base import TorchOptimizerStrategy
from llmpipe.parallel.builder import build_part

TRAINER = "trainer_state.pt"


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

    format = "dcp"

    def __init__(self, cfg, env, args):
        if not torch.distributed.is_initialized():
            raise ValueError("train.parallel.data=fsdp needs a process group: launch with torchrun "
                             "(train.nproc_per_node >= 1), not in-process")
        self.cfg, self.env = cfg, env
        self.mesh = dp_mesh(env.device, env.world)
        # built on meta, sharded, then each rank allocates and initialises only its shards
        self.model = self.module = build_part(cfg, env, args, mesh=self.mesh, data="fsdp")
        self.opt, self.sched = build_optimizer(self.model, cfg, env.world)
        ls = cfg.train.precision.loss_scale
        # NOTE: torch.amp.GradScaler handles DTensor gradients: DTensor's dispatch of
        # _amp_foreach_non_finite_check_and_unscale_ reduces found_inf over the mesh (max), so every
        # rank skips the same steps. Gradients are fp32 (the sharded parameters' dtype).
        self.scaler = dev.grad_scaler(env.device, env.precision, ls.init, ls.growth_interval)
        self.accum, self.max_grad_norm = cfg.train.grad_accum_steps, cfg.train.optim.clip_grad_norm

    def micro_context(self, sync: bool):
        # NOTE: without sync FSDP2 keeps unsharded gradients until the last micro-step's
        # reduce-scatter: less communication, but full-size gradients per rank while accumulating.
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def grad_norm(self) -> torch.Tensor:
        norm = torch.nn.utils.get_total_norm([p.grad for p in self.model.parameters() if p.grad is not None],
                                             foreach=True)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm  # partial over the shards: reduce

    def memory_stats(self) -> dict[str, int]:
        return model_state_bytes(self.model, self.opt)

    def _state(self) -> dict[str, Any]:
        # get_*_state_dict strip wrapper prefixes (checkpoint_wrapper's): keys are llmpipe's names.
        return {"model": get_model_state_dict(self.model), "optim": get_optimizer_state_dict(self.model, self.opt)}

    def write_checkpoint(self, folder: Path, trainer_state: dict[str, Any], asynchronous: bool = False,
                         group=None) -> Written:
        written = save_state(self._state(), folder, self.env.rank, asynchronous, group)
        if self.env.rank != 0:
            return written
        torch.save({**trainer_state, "scheduler": self.sched.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None},
                   Path(folder) / TRAINER)
        return Written(lambda: [*written.claims(), Path(folder) / TRAINER], written.pending)

    def read_checkpoint(self, folder: Path) -> dict[str, Any]:
        state = self._state()  # the shapes and shardings to load into (initialises Adam's states)
        dcp.load(state, storage_reader=SafeReader(Path(folder) / DCP_DIR))  # no pickle.load of .metadata
        set_model_state_dict(self.model, state["model"])
        set_optimizer_state_dict(self.model, self.opt, state["optim"])
        trainer = torch.load(Path(folder) / TRAINER, map_location="cpu", weights_only=True)
        self.sched.load_state_dict(trainer["scheduler"])
        if self.scaler is not None and trainer.get("scaler"):
            self.scaler.load_state_dict(trainer["scaler"])
        return trainer

    def close(self) -> None:
        del self.module, self.model, self.opt, self.sched, self.mesh
