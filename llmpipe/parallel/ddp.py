"""Data parallel with torch DDP (or a single process): full replicas, gradients all-reduced."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from llmpipe import device as dev
from llmpipe.checkpoint import io as ckpt
from llmpipe.models.llama.parallelize import unwrap_state_dict
from llmpipe.optim import build_optimizer
from llmpipe.parallel.base import TorchOptimizerStrategy, clean_name
from llmpipe.parallel.builder import build_part
from llmpipe.parallel.comm_hooks import CommHook

log = logging.getLogger(__name__)
MODEL, OPTIM, TRAINER = "model.safetensors", "optimizer.pt", "trainer_state.pt"


def apply_ddp(model: nn.Module, device: torch.device, parallel) -> DDP:
    """Wrap `model` in DDP. Parameters are broadcast from rank 0 at construction."""
    return DDP(
        model,
        device_ids=None if device.type == "cpu" else [device.index],
        bucket_cap_mb=parallel.bucket_cap_mb,
        gradient_as_bucket_view=parallel.gradient_as_bucket_view,
        static_graph=parallel.static_graph,
        # NOTE: torch 2.13 deprecates broadcast_buffers for forward_sync_buffers (buffers are synced
        # at init either way). llmpipe's only buffers are the RoPE tables, identical on every rank.
        forward_sync_buffers=parallel.broadcast_buffers,
    )


class DDPStrategy(TorchOptimizerStrategy):
    """DDP across ranks (plain module in one process); torch AdamW; autocast + GradScaler for fp16."""

    format = "full"

    def __init__(self, cfg, env, args):
        self.cfg, self.env = cfg, env
        self.model = model = build_part(cfg, env, args)
        self.module = apply_ddp(model, env.device, cfg.train.parallel) if env.world > 1 else model
        self.hook, par = None, cfg.train.parallel
        if env.world > 1:
            self.hook = CommHook(par, self.module, {id(p): clean_name(n) for n, p in model.named_parameters()})
        elif par.comm_hook != "none" and env.main:
            log.info("train.parallel.comm_hook=%s: one process communicates nothing; the hook is not used",
                     par.comm_hook)
        if env.main and self.hook is not None and par.comm_hook == "powersgd" \
                and par.start_powersgd_iter >= cfg.train.max_steps:
            log.warning("train.parallel.start_powersgd_iter=%d >= train.max_steps=%d: PowerSGD never compresses "
                        "in this run (every step is a plain all-reduce)", par.start_powersgd_iter, cfg.train.max_steps)
        self.opt, self.sched = build_optimizer(model, cfg, env.world)
        ls = cfg.train.precision.loss_scale
        self.scaler = dev.grad_scaler(env.device, env.precision, ls.init, ls.growth_interval)
        self.accum, self.max_grad_norm = cfg.train.grad_accum_steps, cfg.train.optim.clip_grad_norm
        # NOTE: DDP static_graph + no_sync in the very first step trips an internal assert
        # (pytorch #143580): that step syncs every micro-step instead.
        self.sync_first_step = env.world > 1 and cfg.train.parallel.static_graph

    def forward_context(self):
        return dev.autocast(self.env.device, self.env.precision)

    def micro_context(self, sync: bool):
        if sync and self.hook is not None and self.hook.kind == "none":
            self.hook.count_plain(self.model.parameters())  # what DDP's own all-reduce will send
        return contextlib.nullcontext() if sync or self.env.world == 1 else self.module.no_sync()

    def comm_bytes(self) -> int | None:
        return self.hook.take_bytes() if self.hook is not None else None

    def write_checkpoint(self, folder: Path, trainer_state: dict[str, Any]) -> list[Path]:
        hook = self.hook.write(folder, self.env.rank) if self.hook is not None else []  # every rank's own
        if self.env.rank != 0:  # replicas are identical: rank 0 writes the whole state
            return hook
        save_file({k: v.detach().contiguous().cpu() for k, v in unwrap_state_dict(self.module).items()},
                  str(folder / MODEL))
        torch.save(self.opt.state_dict(), folder / OPTIM)
        torch.save({**trainer_state, "scheduler": self.sched.state_dict(),
                    "scaler": self.scaler.state_dict() if self.scaler is not None else None}, folder / TRAINER)
        return [folder / MODEL, folder / OPTIM, folder / TRAINER, *hook]

    def read_checkpoint(self, folder: Path) -> dict[str, Any]:
        device = self.env.device
        self.model.load_state_dict(load_file(str(folder / MODEL), device=str(device)), strict=True)
        self.opt.load_state_dict(torch.load(folder / OPTIM, map_location=device, weights_only=True))
        state = torch.load(folder / TRAINER, map_location="cpu", weights_only=True)
        self.sched.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.hook is not None:
            self.hook.read(folder, self.env.rank, self.env.world, ckpt.read_meta(folder).get("world_size"))
        return state

    def close(self) -> None:
        del self.module, self.model, self.opt, self.sched
