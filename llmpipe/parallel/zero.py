"""Data parallel with DeepSpeed ZeRO 1/2/3 (optionally offloading to host memory).

ZeRO shards the optimizer states (stage 1), then the gradients (2), then the parameters (3) across
the data-parallel ranks. DeepSpeed's JSON config is generated from llmpipe's by `deepspeed_config`
(llmpipe.parallel.zero_config, pure functions), never kept by hand beside it. The optimizer is
DeepSpeed's own AdamW where its compiled ops are prebuilt, otherwise llmpipe.optim's torch AdamW,
passed in as a "client optimizer" (train.parallel.zero_optimizer); the lr schedule travels with it
either way. `deepspeed` is imported only when a ZeroStrategy is built.

Checkpoints: each llmpipe checkpoint folder holds DeepSpeed's tag folder `deepspeed/` (per-rank
model and optimizer state files, with llmpipe's trainer state as DeepSpeed's client state), the
`latest` file and DeepSpeed's zero_to_fp32.py; llmpipe.checkpoint.zero consolidates them.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist

from llmpipe.checkpoint.state import TrainState
from llmpipe.parallel.base import Strategy
from llmpipe.parallel.compose import compose
from llmpipe.parallel.zero_config import check_batch, deepspeed_config, ds_optimizer_built, use_ds_optimizer  # noqa: F401


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO around the loop's model, torch AdamW and LambdaLR."""

    format = state_format = "deepspeed"
    supports_replica_checks = False  # parameters and gradients live in DeepSpeed's partitions

    def __init__(self, cfg, env, args):
        if not dist.is_initialized():
            raise ValueError("train.parallel.data=zero needs a process group: run under torchrun "
                             "(the train stage does, also for nproc_per_node=1)")
        # NOTE: DeepSpeed picks its accelerator by probing (cuda before cpu), which need not be the
        # device llmpipe resolved (run.device=cpu on a GPU host); DS_ACCELERATOR makes it the same.
        # torch's device types cpu/cuda/npu are DeepSpeed's accelerator names.
        os.environ.setdefault("DS_ACCELERATOR", env.device.type)
        import deepspeed  # heavy, and only needed for data=zero

        self.cfg, self.env = cfg, env
        own = use_ds_optimizer(cfg)
        self.ds_config = deepspeed_config(cfg, env.world, env.precision, ds_optimizer=own)
        # ZeRO-3 partitions every parameter as it is built; ZeRO-1/2 keep whole parameters. DeepSpeed
        # scales fp16 losses itself.
        c = compose(cfg, env, args, zero3_config=self.ds_config if cfg.train.parallel.zero_stage == 3 else None,
                    scaler=False)
        (model,), (optimizer,), (scheduler,) = c.parts, c.optimizers, c.schedulers
        kwargs: dict[str, Any] = {"optimizer": optimizer, "lr_scheduler": scheduler}
        if own:  # DeepSpeed builds its AdamW over the same param groups (no decay on norms)
            groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in optimizer.param_groups]
            factor = scheduler.lr_lambdas[0]
            kwargs = {"model_parameters": groups,
                      "lr_scheduler": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, factor)}
        # NOTE: each rank holds (its slice of) the same initial values one process would draw, so
        # fp32 losses equal DDP's bitwise.
        engine, _, _, _ = deepspeed.initialize(model=model, config=self.ds_config, **kwargs)
        self.engine = self.module = engine
        self.parts, self.opts, self.scheds = [engine.module], [engine.optimizer], [engine.lr_scheduler]
        check_batch(engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps(),
                    engine.dp_world_size, engine.train_batch_size())
        self.accum = cfg.train.grad_accum_steps
        self._micro = 0  # micro-steps since the last optimizer step

    def forward_context(self):
        # NOTE: no autocast. DeepSpeed's bf16/fp16 sections cast the module itself (weights, gradients
        # and activations in that dtype, fp32 master weights in the optimizer), unlike DDP's autocast
        # over fp32 weights; so bf16 losses agree with DDP only to bf16 precision. The fp32 masters are
        # copied from the cast module, so they start rounded to bf16 (harmless from a random init).
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def micro_context(self, sync: bool):
        # NOTE: the loop calls backward accum times, then step once. DeepSpeed's own counter assumes
        # engine.step() after every micro-batch, so the boundary is set explicitly (its documented
        # "set_gradient_accumulation_boundary" style). The loop's `sync` is not used: it is also True
        # for every micro-step of a process's first step (a DDP workaround).
        self._micro += 1
        self.engine.set_gradient_accumulation_boundary(self._micro == self.accum)
        yield

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)  # divides by gradient_accumulation_steps, scales for fp16

    def step(self, number: int) -> float:
        self.step_number = number
        if self._micro != self.accum:
            raise RuntimeError(f"ZeRO step after {self._micro} micro-steps, expected {self.accum}")
        before = self.engine.global_steps
        self.engine.step()  # clip, optimizer step, lr schedule step (skipped on fp16 overflow), zero grads
        if self.engine.global_steps != before + 1:
            raise RuntimeError(f"DeepSpeed took {self.engine.global_steps - before} steps instead of 1")
        self._micro = 0
        norm = self.engine.get_global_grad_norm()  # before clipping, like clip_grad_norm_'s result
        return float(norm) if norm is not None else float("nan")

    def lr(self) -> float:
        return self.engine.get_lr()[0]

    flat_param_groups = True

    def load_full(self, model, optim) -> None:
        """Another layout's checkpoint into ZeRO's partitions, through DeepSpeed's public tensor-fragment
        API (safe_set_full_*): the fp32 masters and AdamW's moments; then the module's own weights (whole
        under ZeRO-1/2, this rank's partitions under ZeRO-3) and the optimizer's step count."""
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        from llmpipe.parallel.base import clean_name
        from llmpipe.parallel.builder import write_partition

        steps = {float(s["step"]) for s in optim.values()}
        inner = self.engine.optimizer.optimizer  # the torch optimizer over DeepSpeed's flat groups
        # NOTE: torch's AdamW makes its states at the first step, and DeepSpeed links each parameter's
        # fragments of them only then: made here as AdamW would, then linked, so they can be set.
        flats = [f for g in inner.param_groups for f in g["params"]]
        flats += getattr(self.engine.optimizer, "fp32_partitioned_groups_flat", [])  # ZeRO-3's sub-groups
        for flat in flats:
            state = inner.state[flat]
            state.setdefault("step", torch.tensor(0.0))
            for key in ("exp_avg", "exp_avg_sq"):
                state.setdefault(key, torch.zeros_like(flat))
        link = getattr(self.engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
        if link is not None:  # ZeRO-1/2 (private in DeepSpeed 0.19)
            link()
        for name, p in self.engine.module.named_parameters():
            n = clean_name(name)
            full = model[n].float()
            if p.requires_grad:  # LoRA's frozen base has no master weight or moments
                safe_set_full_fp32_param(p, full)
                for key in ("exp_avg", "exp_avg_sq"):
                    safe_set_full_optimizer_state(p, optim[n][key].float(), key)
            with torch.no_grad():
                if hasattr(p, "ds_tensor"):
                    write_partition(p, full, self.env.rank, self.env.world)
                else:
                    p.data.copy_(full.to(p.dtype))
        for state in inner.state.values():
            if "step" in state:
                state["step"] = torch.tensor(max(steps), dtype=torch.float32)

    def optimizers(self) -> list[tuple[Any, Any]]:
        return [(self.engine.optimizer, self.engine.lr_scheduler)]

    def train_state(self) -> TrainState:
        """DeepSpeed owns the module, optimizer and schedule: its engine writes and reads them."""
        ts = super().train_state()
        ts.engine = self.engine
        return ts

    def loss_scale(self) -> float | None:
        if self.env.precision != "fp16":
            return None
        return float(self.engine.optimizer.cur_scale)

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.module, self.parts, self.opts, self.scheds
