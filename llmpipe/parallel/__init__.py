"""Parallel layouts: one builder (builder.py) and the strategies the training loop drives."""

from __future__ import annotations


def build_strategy(cfg, env, args):
    """The strategy for the config's layout, with its model built (llmpipe.parallel.builder) and
    its optimizer and schedule (llmpipe.optim): the mesh strategy for tp/pp > 1 (DDP's `replicate` or
    FSDP2 on the dp axis) and for data=fsdp (dp x 1 x 1); torch DDP for data=ddp, DeepSpeed for zero."""
    p = cfg.train.parallel
    if p.tp > 1 or p.pp > 1 or p.data == "fsdp":
        from llmpipe.parallel.model_parallel import MeshStrategy

        return MeshStrategy(cfg, env, args)
    if p.data == "ddp":
        from llmpipe.parallel.ddp import DDPStrategy

        return DDPStrategy(cfg, env, args)
    if p.data == "zero":
        from llmpipe.parallel.zero import ZeroStrategy

        return ZeroStrategy(cfg, env, args)
    raise ValueError(f"train.parallel.data: unknown strategy {p.data!r}")
