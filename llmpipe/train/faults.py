"""Test-only fault injection in the training loop, behind one call per place it acts.

The faults themselves and their environment switches are llmpipe.debug's (LLMPIPE_PERTURB_PARAMS_RANK,
LLMPIPE_PERTURB_GRADS, LLMPIPE_INJECT_NAN, LLMPIPE_HANG, LLMPIPE_RAISE, LLMPIPE_KILL). `install()`
arms them when one of those variables is set (train() calls it once at start; a test may call it
too); until then `after_build` and `before_optimizer_step` return at once, so the step pays one
boolean test.
"""

from __future__ import annotations

import os

from llmpipe import debug

SWITCHES = ("LLMPIPE_PERTURB_PARAMS_RANK", "LLMPIPE_PERTURB_GRADS", "LLMPIPE_INJECT_NAN", "LLMPIPE_HANG",
            "LLMPIPE_RAISE", "LLMPIPE_KILL")

_armed = False


def install() -> bool:
    """Arm the faults whose environment variables are set; returns whether any is."""
    global _armed
    _armed = any(os.environ.get(name) for name in SWITCHES)
    return _armed


def after_build(strategy, rank: int) -> None:
    """LLMPIPE_PERTURB_PARAMS_RANK: a replica whose parameters differ from the start."""
    if _armed and strategy.supports_replica_checks:
        debug.perturb_params(strategy.named_parameters(), rank)


def before_optimizer_step(strategy, step: int, rank: int) -> None:
    """The faults of optimizer step `step` (1-based): a rank that raises, dies or stops answering,
    then gradients nudged or poisoned with a NaN (where they are the real tensors)."""
    if not _armed:
        return
    debug.hang(step, rank)
    if strategy.supports_replica_checks:
        grads = [(n, p.grad) for n, p in strategy.named_parameters()]
        debug.perturb_grads(grads, step, rank)
        debug.inject_nan(grads, step, rank)
