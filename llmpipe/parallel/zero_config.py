"""DeepSpeed's config for llmpipe's, as pure functions (no DeepSpeed import): the zero_optimization,
precision and optimizer sections, the batch arithmetic, and whether DeepSpeed's own compiled AdamW is
available. llmpipe.parallel.zero builds the engine from it."""

from __future__ import annotations

import math
from typing import Any

from llmpipe.optim import peak_lr

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
