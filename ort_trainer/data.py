"""Samplers that balance the work of data-parallel ranks (as in ONNX Runtime's training guide).

With variable-length samples, a rank that draws the long ones holds every other rank back at
each all-reduce. ``LoadBalancingDistributedSampler`` gives each rank the same number of samples
and about the same total *complexity* (e.g. sequence length); ``LoadBalancingDistributedBatchSampler``
groups a rank's samples into batches of similar complexity and makes every rank run the same
number of batches.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Sequence

import numpy as np

from .distributed import current_world


def _default_world() -> tuple[int, int]:
    try:
        world = current_world()
    except ImportError:  # no mpi4py, and not under torchrun: one rank
        return 1, 0
    return world.size, world.rank


class LoadBalancingDistributedSampler:
    """Assigns every sample of a map-style dataset to exactly one rank per epoch, balancing complexity.

    Samples are ordered by complexity (heaviest first; within groups of ``group_size`` when given)
    and dealt out in rounds of ``world_size``: in each round the heaviest sample goes to the rank
    with the smallest total so far. Every rank gets the same count, and the ranks' totals differ
    by at most one sample's complexity. Like ``torch.utils.data.DistributedSampler``, with
    ``drop_last=False`` the dataset is padded by repeating samples so that it divides evenly;
    with ``drop_last=True`` the lightest tail is dropped instead.

    Args:
        dataset: a map-style dataset (``len`` and ``[i]``).
        complexity_fn: ``sample -> number``, e.g. ``len`` of a token sequence.
        world_size, rank: default to the launcher's (``torchrun`` or ``mpirun``; 1 and 0 without one).
        shuffle: shuffle each rank's samples (and the groups) deterministically per epoch.
        group_size: order by complexity only within consecutive groups of this many samples.
        seed: shuffling seed, the same on every rank.
        drop_last: drop samples instead of padding.
        random_level: 0 (best balance) to 1: noise added to the complexities before ordering.
    """

    def __init__(
        self,
        dataset,
        complexity_fn: Callable,
        world_size: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        group_size: int | None = None,
        seed: int = 0,
        drop_last: bool = False,
        random_level: float = 0.0,
    ):
        default_size, default_rank = _default_world() if world_size is None or rank is None else (world_size, rank)
        self.world_size = default_size if world_size is None else world_size
        self.rank = default_rank if rank is None else rank
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if group_size is not None and group_size < 1:
            raise ValueError(f"group_size must be a positive int or None, got {group_size}")
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"random_level must be in [0, 1], got {random_level}")
        self.dataset = dataset
        self.complexities = np.array([complexity_fn(dataset[i]) for i in range(len(dataset))], dtype=np.float64)
        self.shuffle, self.group_size, self.seed = shuffle, group_size, seed
        self.drop_last, self.random_level = drop_last, random_level
        self.epoch = 0
        n = len(dataset)
        self.num_samples = n // self.world_size if drop_last else math.ceil(n / self.world_size)
        self.total_size = self.num_samples * self.world_size

    def _ordered(self, rng: np.random.Generator) -> np.ndarray:
        keys = self.complexities.copy()
        if self.random_level > 0 and len(keys):
            keys = keys + self.random_level * keys.max() * rng.random(len(keys))
        if self.group_size is None:
            return np.argsort(-keys, kind="stable")
        groups = [np.arange(s, min(s + self.group_size, len(keys))) for s in range(0, len(keys), self.group_size)]
        if self.shuffle:
            groups = [groups[i] for i in rng.permutation(len(groups))]
        return np.concatenate([g[np.argsort(-keys[g], kind="stable")] for g in groups]) if groups else np.array([], int)

    def assignments(self) -> list[list[int]]:
        """Every rank's sample indices for the current epoch (the same on every rank)."""
        rng = np.random.default_rng([self.seed, self.epoch])
        order = self._ordered(rng).tolist()
        if self.drop_last:
            order = order[: self.total_size]
        elif order:
            while len(order) < self.total_size:
                order += order[: self.total_size - len(order)]
        totals = np.zeros(self.world_size)
        assigned: list[list[int]] = [[] for _ in range(self.world_size)]
        for start in range(0, len(order), self.world_size):
            round_ = sorted(order[start:start + self.world_size], key=lambda i: -self.complexities[i])
            for index, rank in zip(round_, np.argsort(totals, kind="stable")):
                assigned[rank].append(index)
                totals[rank] += self.complexities[index]
        if self.shuffle:
            assigned = [[part[i] for i in rng.permutation(len(part))] for part in assigned]
        return assigned

    def __iter__(self) -> Iterator[int]:
        return iter(self.assignments()[self.rank])

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (call it on every rank before each epoch)."""
        self.epoch = epoch


class LoadBalancingDistributedBatchSampler:
    """Batches a rank's samples by complexity; every rank yields the same number of batches.

    Args:
        sampler: a ``LoadBalancingDistributedSampler``.
        batch_fn: ``indices (sorted by complexity) -> list of batches (lists of indices)``, e.g.
            fixed-size chunks or a token budget per batch.
        drop_last: drop the batches past the smallest rank's count (else pad the others by
            repeating their first batches).
        random_level: 0 keeps batches in complexity order; up to 1 shuffles their order more and more.
    """

    def __init__(self, sampler: LoadBalancingDistributedSampler,
                 batch_fn: Callable[[Sequence[int]], list[list[int]]], drop_last: bool = False,
                 random_level: float = 0.0):
        if not isinstance(sampler, LoadBalancingDistributedSampler):
            raise TypeError("sampler must be a LoadBalancingDistributedSampler")
        if not 0.0 <= random_level <= 1.0:
            raise ValueError(f"random_level must be in [0, 1], got {random_level}")
        self.sampler, self.batch_fn = sampler, batch_fn
        self.drop_last, self.random_level = drop_last, random_level

    def _batches(self, indices: list[int]) -> list[list[int]]:
        ordered = sorted(indices, key=lambda i: self.sampler.complexities[i])
        return [list(b) for b in self.batch_fn(ordered)]

    def batches(self) -> list[list[int]]:
        """This rank's batches for the current epoch."""
        per_rank = [self._batches(part) for part in self.sampler.assignments()]
        count = min(map(len, per_rank)) if self.drop_last else max(map(len, per_rank))
        mine = per_rank[self.sampler.rank]
        if self.drop_last:
            mine = mine[:count]
        else:
            mine = mine + [mine[i % len(mine)] for i in range(count - len(mine))] if mine else []
        if self.random_level > 0 and mine:
            rng = np.random.default_rng([self.sampler.seed, self.sampler.epoch, self.sampler.rank])
            keys = np.arange(len(mine)) + self.random_level * len(mine) * rng.random(len(mine))
            mine = [mine[i] for i in np.argsort(keys, kind="stable")]
        return mine

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches())

    def __len__(self) -> int:
        return len(self.batches())

    def set_epoch(self, epoch: int) -> None:
        """Reshuffle for ``epoch`` (sets the sampler's epoch)."""
        self.sampler.set_epoch(epoch)
