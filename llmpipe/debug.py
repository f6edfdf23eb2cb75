"""Troubleshooting switches (train.debug): replicas' parameters and gradients compared across
data-parallel ranks, the NaN/Inf guard, and test-only fault injection.

Replica checks compare a checksum per parameter (float64 sum, absolute sum and position-weighted
sum of its local tensor) gathered over the data-parallel group; parameters sharded across the
replicas (FSDP2, ZeRO-3) differ by design and are left out. The fault injections below run only
when their environment variable is set (tests set them to trigger each switch on purpose):

    LLMPIPE_PERTURB_PARAMS_RANK=r       after building, rank r nudges its first parameter
    LLMPIPE_PERTURB_GRADS=step:rank     at that (1-based) step, that rank scales its gradients
    LLMPIPE_INJECT_NAN=step[:rank]      at that step, a NaN in that rank's first weight gradient
    LLMPIPE_HANG=step:rank              at that step, that rank stops answering (sleeps), so its peers'
                                        next collective runs into train.dist_timeout_s
    LLMPIPE_RAISE=step:rank             at that step, that rank raises a RuntimeError (an exception, as
                                        a bug would: its error file names it)
    LLMPIPE_KILL=step:rank              at that step, that rank SIGKILLs itself, once: only in torchrun's
                                        first attempt (TORCHELASTIC_RESTART_COUNT 0), so a restart goes on
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from llmpipe.errors import UserError

log = logging.getLogger("llmpipe.train")


class ReplicaMismatch(UserError, RuntimeError):
    """Data-parallel replicas that should hold the same values do not."""


class Diverged(UserError, FloatingPointError):
    """A run gone non-finite (gradients, loss) or whose fp16 loss scale collapsed, per train.debug."""


def _local_replicated(t: torch.Tensor) -> torch.Tensor | None:
    """The local tensor when it is whole across the data-parallel ranks; None when sharded over them."""
    if not isinstance(t, DTensor):
        return t
    names = t.device_mesh.mesh_dim_names or ()
    for i, placement in enumerate(t.placements):
        if placement.is_shard() and (names[i] if i < len(names) else "dp") == "dp":
            return None
    return t.to_local()


def _checksum(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().flatten().double()
    w = torch.arange(x.numel(), device=x.device, dtype=torch.float64) % 7 + 1
    return torch.stack([x.sum(), x.abs().sum(), (x * w).sum()])


def check_replicas(named: list[tuple[str, torch.Tensor | None]], group, what: str, step: int) -> int:
    """Raise ReplicaMismatch naming the tensors whose checksums differ across `group` (None: every
    rank); returns how many tensors were compared."""
    items = [(n, loc) for n, t in named if t is not None and (loc := _local_replicated(t)) is not None]
    if not dist.is_initialized() or dist.get_world_size(group) == 1 or not items:
        return len(items)
    mine = torch.stack([_checksum(t) for _, t in items]).cpu()
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    bad: dict[str, list[int]] = {}
    for r, theirs in zip(ranks, gathered):
        for i in torch.nonzero((theirs != gathered[0]).any(dim=1)).flatten().tolist():
            bad.setdefault(items[i][0], []).append(r)
    if bad:
        names = ", ".join(f"{n} (ranks {v} differ from rank {ranks[0]})" for n, v in list(bad.items())[:5])
        raise ReplicaMismatch(f"step {step}: {what} differ across data-parallel replicas in {len(bad)} of "
                              f"{len(items)} tensors: {names}")
    return len(items)


def nonfinite(named: list[tuple[str, torch.Tensor | None]]) -> list[str]:
    """Names of the tensors holding a NaN or Inf (local shards)."""
    out = []
    for name, t in named:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        if not bool(torch.isfinite(local).all()):
            out.append(name)
    return out


def nonfinite_error(names: list[str], step: int, rank: int) -> Diverged:
    listed = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
    return Diverged(f"step {step}: non-finite gradients on rank {rank} in {listed} "
                              "(train.debug.nan_guard=stop; 'skip' drops such updates and goes on)")


# -- test-only fault injection ------------------------------------------------------------------------

def _env_step_rank(name: str) -> tuple[int, int | None] | None:
    value = os.environ.get(name)
    if not value:
        return None
    step, _, rank = value.partition(":")
    return int(step), (int(rank) if rank else None)


def perturb_params(named: list[tuple[str, torch.Tensor]], rank: int) -> None:
    target = os.environ.get("LLMPIPE_PERTURB_PARAMS_RANK")
    if target is not None and int(target) == rank and named:
        name, p = named[0]
        with torch.no_grad():
            (p.to_local() if isinstance(p, DTensor) else p).add_(1e-3)
        log.warning("LLMPIPE_PERTURB_PARAMS_RANK: rank %d nudged %s", rank, name)


def perturb_grads(named: list[tuple[str, torch.Tensor | None]], step: int, rank: int) -> None:
    hit = _env_step_rank("LLMPIPE_PERTURB_GRADS")
    if hit and hit[0] == step and hit[1] in (None, rank):
        with torch.no_grad():
            for _, g in named:
                if g is not None:
                    (g.to_local() if isinstance(g, DTensor) else g).mul_(1.001)


def _raise_or_kill(step: int, rank: int) -> None:
    hit = _env_step_rank("LLMPIPE_RAISE")
    if hit and hit[0] == step and hit[1] in (None, rank):
        raise RuntimeError(f"LLMPIPE_RAISE: injected failure on rank {rank} at step {step}")
    hit = _env_step_rank("LLMPIPE_KILL")
    if hit and hit[0] == step and hit[1] in (None, rank) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        import signal

        log.warning("LLMPIPE_KILL: rank %d SIGKILLs itself at step %d", rank, step)
        os.kill(os.getpid(), signal.SIGKILL)


def hang(step: int, rank: int) -> None:
    """The per-step process faults: LLMPIPE_RAISE, LLMPIPE_KILL, then LLMPIPE_HANG."""
    _raise_or_kill(step, rank)
    hit = _env_step_rank("LLMPIPE_HANG")
    if hit and hit[0] == step and hit[1] in (None, rank):
        import time

        log.warning("LLMPIPE_HANG: rank %d stops answering at step %d", rank, step)
        time.sleep(3600)


def inject_nan(named: list[tuple[str, torch.Tensor | None]], step: int, rank: int) -> None:
    hit = _env_step_rank("LLMPIPE_INJECT_NAN")
    if hit and hit[0] == step and hit[1] in (None, rank):
        for name, g in named:
            if g is not None and g.ndim >= 2:
                with torch.no_grad():
                    (g.to_local() if isinstance(g, DTensor) else g).view(-1)[0] = float("nan")
                log.warning("LLMPIPE_INJECT_NAN: rank %d put a NaN into the gradient of %s", rank, name)
                return
