"""The global sampler: the position in the data is a global sample index, not a per-rank one.

Step ``g`` trains on global positions ``[g*G, (g+1)*G)`` of the epoch's seeded permutation (G = global
batch). Rank ``r`` takes micro-batch ``a`` (of ``A`` accumulation micro-steps) at offsets
``[(a*W + r)*m, (a*W + r + 1)*m)``. So the samples of a step do not depend on the world size W, and a run
resumed at another world size continues at the same global index: nothing skipped, nothing seen twice.

With ``membership`` (per-step fault tolerance) the world and rank are asked for at every step, as is the
position: the step's quorum decides how many ranks share its global batch, and a discarded step's samples are
drawn again by the next quorum.
"""

from __future__ import annotations

from typing import Callable, Iterator, Optional

import torch
from torch.utils.data import Sampler


class GlobalBatchSampler(Sampler[list[int]]):
    """Yields this rank's micro-batches (lists of dataset indices), forever, from ``start_sample`` on."""

    def __init__(self, dataset_len: int, global_batch: int, micro_batch: int, world_size: int, rank: int,
                 seed: int = 0, start_sample: int = 0, drop_last: bool = True,
                 membership: Optional[Callable[[], tuple[int, int, int]]] = None):
        if global_batch % (micro_batch * world_size):
            raise ValueError(f"global batch {global_batch} is not divisible by micro {micro_batch} x world {world_size}")
        if start_sample % global_batch:
            raise ValueError(f"start_sample {start_sample} is not at a global-batch boundary ({global_batch})")
        self.n, self.G, self.m, self.W, self.r = dataset_len, global_batch, micro_batch, world_size, rank
        self.seed, self.start_sample = seed, start_sample
        self.membership = membership
        """Per step: (world size, rank, global sample position) of the step about to be drawn."""
        # drop_last: the last partial global batch of an epoch is dropped; otherwise it is padded by wrapping
        # around to the start of the permutation (like DistributedSampler).
        self.samples_per_epoch = (self.n // self.G) * self.G if drop_last else -(-self.n // self.G) * self.G
        if self.samples_per_epoch == 0:
            raise ValueError(f"the dataset ({self.n} samples) is smaller than one global batch ({self.G})")

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per step on this rank (with ``membership``: at the coming step's world size)."""
        world = self.membership()[0] if self.membership is not None else self.W
        return self.G // (self.m * world)

    def epoch_of(self, sample_index: int) -> int:
        return sample_index // self.samples_per_epoch

    def _permutation(self, epoch: int) -> torch.Tensor:
        perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + epoch))
        pad = self.samples_per_epoch - self.n
        return torch.cat([perm, perm[:pad]]) if pad > 0 else perm

    def __iter__(self) -> Iterator[list[int]]:
        sample, epoch, perm = self.start_sample, -1, None
        while True:
            if self.membership is not None:
                self.W, self.r, sample = self.membership()
                if self.G % (self.m * self.W):
                    raise ValueError(f"global batch {self.G} is not divisible by micro {self.m} x world {self.W}")
            if self.epoch_of(sample) != epoch:
                epoch = self.epoch_of(sample)
                perm = self._permutation(epoch)
            base = sample % self.samples_per_epoch
            for a in range(self.accumulation_steps):
                offset = base + (a * self.W + self.r) * self.m
                yield perm[offset: offset + self.m].tolist()
            sample += self.G
