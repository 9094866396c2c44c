"""Which samples each rank reads at each step, independent of how many ranks there are.

The order of an epoch is one permutation of the dataset, fixed by (seed, epoch). A step
trains on the next G samples of that order (the global batch), whatever the world size. A
rank takes an equal share of it, split into micro-batches. The position to resume from is
therefore (epoch, samples done), which survives a change of world size: every sample is read
once per epoch, even when ranks come and go between steps.

Shares are made equal by padding with weight-0 copies: the last global batch of an epoch is
usually short, and G need not divide by world size x micro-batch. The loss weights each
sample by ``weight / real samples in the global batch``, so padding adds nothing to the gradient.

Padding does reach BatchNorm: a weight-0 copy still takes part in its micro-batch's mean and
variance (and in the running statistics), so a BN model's steps depend slightly on the world
size whenever there is padding. :func:`fixed_global_layout` therefore picks a padding-free
layout whenever the world size divides the global batch; the short last batch of an epoch is
padded whatever the layout.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch


class SampleKey(NamedTuple):
    """What a dataset needs to produce one sample: which one, its loss weight, its augmentation seed."""

    index: int
    weight: float
    seed: int


@dataclass(frozen=True)
class Layout:
    """How one global batch is split: ``accumulation`` micro-steps of ``micro_batch`` per rank."""

    world_size: int
    accumulation: int
    micro_batch: int

    @property
    def slots(self) -> int:
        return self.world_size * self.accumulation * self.micro_batch


def fixed_global_layout(global_batch: int, world_size: int, max_micro_batch: int) -> Layout:
    """The fewest micro-steps that fit ``global_batch`` in micro-batches of at most ``max_micro_batch``.

    When the world size divides the global batch, up to twice as many micro-steps are allowed
    to find a layout with no padding (see the module docstring: padding reaches BatchNorm).
    """
    accumulation = math.ceil(global_batch / (world_size * max_micro_batch))
    per_rank, remainder = divmod(global_batch, world_size)
    if remainder == 0:
        for candidate in range(accumulation, 2 * accumulation + 1):
            if per_rank % candidate == 0:
                return Layout(world_size, candidate, per_rank // candidate)
    return Layout(world_size, accumulation, math.ceil(global_batch / (world_size * accumulation)))


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A per-sample seed for augmentation and masking, the same on whichever rank reads it."""
    return ((seed * 1_000_003 + epoch) * 2_147_483_647 + index) & 0x7FFF_FFFF_FFFF


@functools.lru_cache(maxsize=1)
def epoch_order(dataset_size: int, seed: int, epoch: int) -> torch.Tensor:
    """One epoch's order: a permutation of the whole dataset, fixed by (seed, epoch). The newest is kept
    for the process (as much memory as one plan held before: 8 bytes a sample): a worker that joins a
    new round in place builds a new plan (the global batch may change), and torch.randperm takes
    seconds on a large dataset (6.8 s at 50,000,000 samples on a core of this project's CI machine),
    a stall at every regroup. Callers only read it."""
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(dataset_size, generator=generator)


class ElasticBatchPlan:
    """The global order of samples and each rank's share of every step."""

    def __init__(self, dataset_size: int, global_batch: int, seed: int):
        if dataset_size < 1 or global_batch < 1:
            raise ValueError("dataset_size and global_batch must be positive")
        self.dataset_size = dataset_size
        self.global_batch = global_batch
        self.seed = seed

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(self.dataset_size / self.global_batch)

    def order(self, epoch: int) -> torch.Tensor:
        return epoch_order(self.dataset_size, self.seed, epoch)

    def global_batch_indices(self, epoch: int, start: int) -> list[int]:
        """The global batch that begins ``start`` samples into the epoch's order."""
        if not 0 <= start < self.dataset_size:
            raise IndexError(f"offset {start} outside an epoch of {self.dataset_size} samples")
        return self.order(epoch)[start : start + self.global_batch].tolist()

    def rank_micro_batches(self, epoch: int, start: int, rank: int, layout: Layout) -> list[list[SampleKey]]:
        """Rank ``rank``'s micro-batches of one step, padded to equal size with weight-0 keys."""
        indices = self.global_batch_indices(epoch, start)
        if len(indices) > layout.slots:
            raise ValueError(f"layout holds {layout.slots} samples, the global batch has {len(indices)}")
        per_rank = layout.accumulation * layout.micro_batch
        # Interleave so a short (last) global batch leaves every rank some real samples.
        mine = indices[rank :: layout.world_size][:per_rank]
        keys = [SampleKey(i, 1.0, sample_seed(self.seed, epoch, i)) for i in mine]
        keys += [SampleKey(indices[0], 0.0, 0)] * (per_rank - len(keys))
        return [keys[m * layout.micro_batch : (m + 1) * layout.micro_batch] for m in range(layout.accumulation)]

    def real_samples(self, start: int) -> int:
        return min(self.global_batch, self.dataset_size - start)

    def starts(self, first: int) -> range:
        """Offsets of the global batches from ``first`` to the end of the epoch."""
        return range(first, self.dataset_size, self.global_batch)


class MicroBatchSampler(torch.utils.data.Sampler):
    """A DataLoader ``batch_sampler``: one rank's micro-batches from an epoch offset to the epoch's end."""

    def __init__(self, plan: ElasticBatchPlan, epoch: int, first_offset: int, rank: int, layout: Layout):
        self.plan, self.epoch, self.first_offset, self.rank, self.layout = plan, epoch, first_offset, rank, layout

    def __iter__(self) -> Iterator[list[SampleKey]]:
        for start in self.plan.starts(self.first_offset):
            yield from self.plan.rank_micro_batches(self.epoch, start, self.rank, self.layout)

    def __len__(self) -> int:
        return len(self.plan.starts(self.first_offset)) * self.layout.accumulation
