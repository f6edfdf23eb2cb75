"""A tied head across pipeline stages: Megatron's embedding group.

With model.tie_embeddings the output head IS the embedding matrix: one Parameter in every layout that
holds both ends on one rank (DDP, FSDP2 in one unit, ZeRO, TP as one Shard(0) DTensor). A pipeline puts
the embedding on the first stage and the head on the last, so each of those two ranks holds a copy. The
copies start from the same value (llmpipe.models.llama.parallelize.tied_source); after every backward
their gradients are summed over the pair (the gradient of the one shared weight: the embedding's part
plus the head's), so the same AdamW update with the same state keeps them bitwise equal, as Megatron's
embedding group all-reduce does. The global gradient norm counts the pair once (the first stage's),
and `check_equal` verifies, whenever a checkpoint is written or read, that the copies are still one.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

log = logging.getLogger("llmpipe.train")


class TiedCopiesDiffer(RuntimeError):
    """The first and last pipeline stages' copies of a tied embedding are no longer bitwise equal (a bug)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class TiedHead:
    """The pipeline rank's end of a tied embedding (or None where it holds neither end), and the process
    group of the two ranks that hold the ends at this rank's (dp, tp) coordinate: the first stage's
    embedding and the last stage's head cover the same slices (same FSDP / TP sharding), so their local
    shards pair up element by element."""

    def __init__(self, parts: list[nn.Module], stage_ids: list[int], n_stages: int, dims, rank: int):
        self.weight: nn.Parameter | None = None
        self.is_copy = False  # the last stage's head: left out of the gradient norm
        for part, stage in zip(parts, stage_ids):
            if stage == 0:
                self.weight = part.tok_embeddings.weight
            elif stage == n_stages - 1:
                self.weight, self.is_copy = part.output.weight, True
        self.group, per_stage = None, dims.dp * dims.tp
        # NOTE: new_group is collective: every rank creates every pair's group, in the same order
        for offset in range(per_stage):
            pair = [offset, (dims.pp - 1) * per_stage + offset]
            group = dist.new_group(pair)
            if rank in pair:
                self.group = group
        self.stages = (0, n_stages - 1)

    def sync_grads(self) -> None:
        """Sum the two ends' gradients (both ranks then hold the gradient of the one shared weight)."""
        if self.weight is None or self.weight.grad is None:  # a middle stage, or a frozen (LoRA) base
            return
        dist.all_reduce(_local(self.weight.grad), group=self.group)

    def norm_params(self, params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters a global gradient norm counts: the last stage's copy is the first stage's."""
        return [p for p in params if not (self.is_copy and p is self.weight)]

    @torch.no_grad()
    def check_equal(self, when: str) -> None:
        """Verify the two copies are bitwise equal (every rank calls it; `when`: "step N", for the messages);
        raises TiedCopiesDiffer."""
        if self.weight is None:
            return
        local = _local(self.weight).detach().contiguous()
        bits = local.view(torch.int32 if local.element_size() == 4 else torch.int16).int()  # exact comparison
        high, low = bits.clone(), bits.clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=self.group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=self.group)
        differ = int((high != low).sum())
        if differ:
            raise TiedCopiesDiffer(f"{when}: the tied embedding's copies on pipeline stages {self.stages[0]} "
                                   f"and {self.stages[1]} differ in {differ} of {bits.numel()} local elements")
        if dist.get_rank() == 0:
            log.info("%s: tied embedding: pipeline stages %d and %d hold bitwise equal copies", when, *self.stages)
