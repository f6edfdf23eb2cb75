"""Deterministic, resumable assignment of packed samples to (step, micro-step, rank).

The sample stream is an endless sequence of seeded permutations of [0, num_samples). Optimizer
step s consumes the global batch of G = micro_batch * grad_accum * world_size consecutive stream
positions, so the samples a step sees depend only on (seed, consumed samples), never on how the
batch is split across ranks and micro-steps. Resuming needs just the consumed-sample count.
"""

from __future__ import annotations

import numpy as np

from llmpipe.data.errors import DataError


class GlobalBatchSampler:
    def __init__(self, num_samples: int, micro_batch: int, grad_accum: int, world_size: int, seed: int):
        if num_samples < 1:
            raise DataError("no training samples")
        self.num_samples, self.seed = num_samples, seed
        self.micro_batch, self.grad_accum, self.world_size = micro_batch, grad_accum, world_size
        self._perms: dict[int, np.ndarray] = {}

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            self._perms = {epoch: np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)}
        return self._perms[epoch]

    def positions(self, start: int, count: int) -> np.ndarray:
        """Sample indices at stream positions [start, start + count)."""
        out = np.empty(count, dtype=np.int64)
        for i, pos in enumerate(range(start, start + count)):
            epoch, offset = divmod(pos, self.num_samples)
            out[i] = self._perm(epoch)[offset]
        return out

    def micro_batch_indices(self, consumed: int, micro_step: int, rank: int) -> np.ndarray:
        """Sample indices for one rank's micro-batch of the step that starts at `consumed`."""
        start = consumed + (micro_step * self.world_size + rank) * self.micro_batch
        return self.positions(start, self.micro_batch)
