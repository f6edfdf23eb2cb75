"""Data parallel with DeepSpeed ZeRO 1/2/3 (optionally offloading to host memory).

ZeRO shards the optimizer states (stage 1), then the gradients (2), then the parameters (3) across
the data-parallel ranks. DeepSpeed's JSON config is generated from llmpipe's by `deepspeed_config`,
a pure function, never kept by hand beside it. The optimizer is DeepSpeed's own AdamW where its
compiled ops are prebuilt, otherwise the torch AdamW the loop built, passed in as a "client
optimizer" (train.parallel.zero_optimizer); the loop's lr schedule travels with it either way.
`deepspeed` is imported only when a ZeroStrategy is built.

Checkpoints: each llmpipe checkpoint folder holds DeepSpeed's tag folder `deepspeed/` (per-rank
model and optimizer state files, with llmpipe's trainer state as DeepSpeed's client state), the
`latest` file and DeepSpeed's zero_to_fp32.py; llmpipe.checkpoint.zero consolidates them.
"""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from llmpipe.checkpoint import io as ckpt
from llmpipe.optim import build_optimizer, peak_lr
from llmpipe.parallel.base import Strategy
from llmpipe.parallel.builder import build_part, zero3_model

TAG = "deepspeed"  # DeepSpeed's tag folder inside each llmpipe checkpoint folder
_NEVER = 1 << 62  # steps_per_print: llmpipe logs progress itself


def check_batch(micro: int, accum: int, dp: int, train_batch_size: int) -> int:
    """Check train_batch_size = micro x accum x dp; return it, or raise ValueError with the numbers."""
    if min(micro, accum, dp) < 1 or micro * accum * dp != train_batch_size:
        raise ValueError(f"batch arithmetic: micro_batch_size={micro} x grad_accum_steps={accum} x dp={dp} = "
                         f"{micro * accum * dp}, but train_batch_size is {train_batch_size}")
    return train_batch_size


def _precision_sections(precision: str, loss_scale) -> dict[str, Any]:
    """DeepSpeed's bf16 / fp16 sections; fp32 needs neither."""
    if precision == "bf16":
        return {"bf16": {"enabled": True}}
    if precision == "fp16":
        power = math.log2(loss_scale.init)
        if power != int(power):
            raise ValueError(f"train.precision.loss_scale.init={loss_scale.init:g}: DeepSpeed's fp16 scaler "
                             "starts at a power of two (initial_scale_power); use e.g. 65536")
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": int(power),
                         "loss_scale_window": loss_scale.growth_interval}}
    if precision != "fp32":
        raise ValueError(f"precision {precision!r}: expected fp32, bf16 or fp16 (resolve 'auto' first)")
    return {}


def _zero_section(p) -> dict[str, Any]:
    """zero_optimization from train.parallel (validated there: stage 1-3, offload_param only with 3)."""
    zero: dict[str, Any] = {
        "stage": p.zero_stage,
        "reduce_bucket_size": p.reduce_bucket_size,
        "allgather_bucket_size": p.allgather_bucket_size,
        "overlap_comm": p.overlap_comm,
        "contiguous_gradients": p.contiguous_gradients,
    }
    if p.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": p.offload_optimizer, "pin_memory": p.pin_memory}
    if p.offload_param != "none":
        zero["offload_param"] = {"device": p.offload_param, "pin_memory": p.pin_memory}
    return zero


def ds_optimizer_built() -> bool:
    """Whether this DeepSpeed install has its compiled Adam ops prebuilt (DS_BUILD_OPS=1 or a wheel
    built with them); JIT-compiling them at first use is not assumed."""
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return False
    return bool(installed_ops.get("cpu_adam") or installed_ops.get("fused_adam"))


def use_ds_optimizer(cfg) -> bool:
    """train.parallel.zero_optimizer: auto picks DeepSpeed's own AdamW where its ops are built."""
    choice = cfg.train.parallel.zero_optimizer
    return choice == "deepspeed" or (choice == "auto" and ds_optimizer_built())


def _optimizer_section(o, lr: float) -> dict[str, Any]:
    """DeepSpeed's own AdamW (FusedAdam on accelerators, DeepSpeedCPUAdam when offloaded)."""
    return {"type": "AdamW", "params": {"lr": lr, "betas": list(o.betas), "eps": o.eps,
                                        "weight_decay": o.weight_decay}}


def deepspeed_config(cfg, world_size: int, precision: str | None = None, ds_optimizer: bool = False
                     ) -> dict[str, Any]:
    """DeepSpeed's config dict for `cfg` on `world_size` data-parallel ranks (a pure function).

    `precision` is the resolved train precision (fp32 | bf16 | fp16); None takes
    cfg.train.precision.dtype, which must then not be "auto". `ds_optimizer` adds DeepSpeed's own
    AdamW section (otherwise the loop's torch AdamW is passed in as a client optimizer).
    """
    t = cfg.train
    micro, accum = t.micro_batch_size, t.grad_accum_steps
    if world_size < 1:
        raise ValueError(f"deepspeed_config: world_size must be >= 1, got {world_size}")
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "train_batch_size": micro * accum * world_size,  # DeepSpeed checks the same product; so do we after init
        "gradient_clipping": t.optim.clip_grad_norm or 0.0,  # 0: off
        "zero_optimization": _zero_section(t.parallel),
        # The client optimizer is torch AdamW: allowed with ZeRO, and kept with CPU offload (DeepSpeed
        # would otherwise insist on its compiled DeepSpeedCPUAdam).
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": _NEVER,
        "wall_clock_breakdown": False,
    }
    if ds_optimizer:
        ds["optimizer"] = _optimizer_section(t.optim, peak_lr(cfg, world_size))
        del ds["zero_allow_untested_optimizer"], ds["zero_force_ds_cpu_optimizer"]
    ds.update(_precision_sections(precision or t.precision.dtype, t.precision.loss_scale))
    return ds


class ZeroStrategy(Strategy):
    """DeepSpeed ZeRO around the loop's model, torch AdamW and LambdaLR."""

    format = "deepspeed"
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
        # ZeRO-3 partitions every parameter as it is built; ZeRO-1/2 keep whole parameters
        model = (zero3_model(cfg, env, args, self.ds_config) if cfg.train.parallel.zero_stage == 3
                 else build_part(cfg, env, args))
        optimizer, scheduler = build_optimizer(model, cfg, env.world)
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

    def step(self) -> float:
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

    def optimizers(self) -> list[tuple[Any, Any]]:
        return [(self.engine.optimizer, self.engine.lr_scheduler)]

    def loss_scale(self) -> float | None:
        if self.env.precision != "fp16":
            return None
        return float(self.engine.optimizer.cur_scale)

    def write_checkpoint(self, folder: Path, trainer_state: dict[str, Any]) -> list[Path]:
        # Every rank writes its partitions; the trainer state rides along as DeepSpeed's client state.
        self.engine.save_checkpoint(str(folder), tag=TAG, client_state=trainer_state)
        # this rank's partitions (zero_pp_rank_<rank>_mp_rank_00_{optim,model}_states.pt); the rest
        # (model states, `latest`, zero_to_fp32.py: rank 0's) are hashed by rank 0 as unclaimed
        return sorted((Path(folder) / TAG).glob(f"zero_pp_rank_{self.env.rank}_*"))

    def read_checkpoint(self, folder: Path) -> dict[str, Any]:
        written = ckpt.read_meta(folder).get("world_size")
        if written != self.env.world:
            raise ValueError(f"train.checkpoint.resume: {folder} was written by {written} ranks, this run has "
                             f"{self.env.world}; ZeRO partitions resume on the same number of ranks "
                             "(or consolidate the checkpoint and start from its weights)")
        path, client_state = self.engine.load_checkpoint(str(folder), tag=TAG, load_optimizer_states=True,
                                                         load_lr_scheduler_states=True)
        if path is None:
            raise ValueError(f"train.checkpoint.resume: {folder} holds no DeepSpeed checkpoint {TAG!r}")
        return client_state

    def close(self) -> None:
        self.engine.destroy()
        del self.engine, self.module
