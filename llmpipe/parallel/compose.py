"""One composer for every layout: builder -> optimizer -> lr schedule -> loss scaler, over `parts`.

`parts` is a list whatever the layout: one model, or the pipeline stages a rank holds. Each part is
built by llmpipe.parallel.builder in its fixed order and gets its own AdamW and LambdaLR
(llmpipe.optim); the loss scaler (fp16 only) is shared. Strategies wrap what this returns (torch DDP,
DeepSpeed's engine, a pipeline schedule) and add nothing to it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from llmpipe import device as dev
from llmpipe.optim import build_optimizer
from llmpipe.parallel.builder import BuildOptions, build_part, zero3_model

ONE_PART = ((0, 1, None),)  # (stage, n_stages, layer_ids): the whole model


@dataclass
class Composed:
    parts: list[nn.Module]
    optimizers: list[Any]
    schedulers: list[Any]
    scaler: Any  # a GradScaler for fp16, else None


def compose(cfg, env, args, *, mesh: DeviceMesh | None = None, data: str = "none", stages=ONE_PART,
            zero3_config: dict | None = None, scaler: bool = True) -> Composed:
    """This rank's parts (`stages`: (stage, n_stages, layer_ids) per part; `data` and `mesh` as
    builder.build_part takes them; `zero3_config`: ZeRO-3's partitioned build instead), one optimizer
    and schedule per part, and the fp16 loss scaler unless `scaler` is False (DeepSpeed scales itself)."""
    opts = BuildOptions.from_config(cfg)
    if zero3_config is not None:
        parts = [zero3_model(opts, env, args, zero3_config)]
    else:
        parts = [build_part(opts, env, args, mesh=mesh, data=data, stage=s, n_stages=n, layer_ids=ids)
                 for s, n, ids in stages]
    optimizers, schedulers = (list(x) for x in zip(*(build_optimizer(p, cfg, env.world) for p in parts)))
    ls = cfg.train.precision.loss_scale
    # NOTE: torch.amp.GradScaler handles DTensor gradients: DTensor's dispatch of
    # _amp_foreach_non_finite_check_and_unscale_ reduces found_inf over the mesh (max), so every
    # rank skips the same steps.
    grad_scaler = dev.grad_scaler(env.device, env.precision, ls.init, ls.growth_interval) if scaler else None
    return Composed(parts, optimizers, schedulers, grad_scaler)
