"""Data-parallel strategies, chosen by train.parallel.data."""

from __future__ import annotations


def build_strategy(cfg, env, model, optimizer, scheduler):
    """The strategy for cfg.train.parallel.data, wrapping a materialised, initialised model."""
    kind = cfg.train.parallel.data
    if kind == "ddp":
        from llmpipe.parallel.ddp import DDPStrategy

        return DDPStrategy(cfg, env, model, optimizer, scheduler)
    if kind == "zero":
        from llmpipe.parallel.zero import ZeroStrategy

        return ZeroStrategy(cfg, env, model, optimizer, scheduler)
    if kind == "fsdp":
        from llmpipe.parallel.fsdp import FSDPStrategy

        return FSDPStrategy(cfg, env, model, optimizer, scheduler)
    raise ValueError(f"train.parallel.data: unknown strategy {kind!r}")
