"""Data parallel with torch DDP (or a single process): full replicas, gradients all-reduced."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from llmpipe import device as dev
from llmpipe.checkpoint.state import TrainState
from llmpipe.parallel.base import TorchOptimizerStrategy, clean_name
from llmpipe.parallel.comm_hooks import CommHook
from llmpipe.parallel.compose import compose

log = logging.getLogger(__name__)


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
    """DDP across ranks (plain module in one process); torch AdamW; autocast + GradScaler for fp16.
    A strategy of its own for torch DDP's knobs: buckets, static_graph, communication hooks."""

    format, state_format = "dcp", "dcp-nested"  # as FSDP2's: either reads the other's by its own reader
    legacy_formats = ("full",)  # what DDP wrote before DCP: old runs resume by the same reader as ever

    def __init__(self, cfg, env, args):
        self.cfg, self.env = cfg, env
        c = compose(cfg, env, args)
        self.parts, self.opts, self.scheds, self.scaler = c.parts, c.optimizers, c.schedulers, c.scaler
        model = self.parts[0]
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
        self.accum, self.max_grad_norm = cfg.train.grad_accum_steps, cfg.train.optim.clip_grad_norm
        # NOTE: DDP static_graph + no_sync in the very first step trips an internal assert
        # (pytorch #143580): that step syncs every micro-step instead.
        self.sync_first_step = env.world > 1 and cfg.train.parallel.static_graph

    def forward_context(self):
        return dev.autocast(self.env.device, self.env.precision)

    def micro_context(self, sync: bool):
        if sync and self.hook is not None and self.hook.kind == "none":
            self.hook.count_plain(self.parts[0].parameters())  # what DDP's own all-reduce will send
        return contextlib.nullcontext() if sync or self.env.world == 1 else self.module.no_sync()

    def comm_bytes(self) -> int | None:
        return self.hook.take_bytes() if self.hook is not None else None

    def train_state(self) -> TrainState:
        ts = super().train_state()
        ts.hook = self.hook  # each rank's PowerSGD error feedback
        return ts

    def close(self) -> None:
        del self.module, self.parts, self.opts, self.scheds
