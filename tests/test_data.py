"""Load-balancing samplers: coverage, balance, determinism."""

import numpy as np
import pytest

from ort_trainer.data import LoadBalancingDistributedBatchSampler, LoadBalancingDistributedSampler

RNG = np.random.default_rng(0)
DATASET = [list(range(int(n))) for n in RNG.integers(1, 200, size=101)]  # variable-length "sequences"


def _samplers(world_size, **kwargs):
    return [LoadBalancingDistributedSampler(DATASET, len, world_size=world_size, rank=r, **kwargs)
            for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_sample_on_exactly_one_rank_and_balanced(world_size, shuffle):
    samplers = _samplers(world_size, shuffle=shuffle, drop_last=True)
    parts = [list(s) for s in samplers]
    flat = [i for part in parts for i in part]
    assert len(flat) == len(set(flat))  # no overlap
    assert len(flat) == (len(DATASET) // world_size) * world_size
    assert len({len(part) for part in parts}) == 1
    totals = [sum(len(DATASET[i]) for i in part) for part in parts]
    assert max(totals) - min(totals) <= max(len(s) for s in DATASET)  # within one sample's complexity


def test_padding_follows_torch_distributed_sampler():
    parts = [list(s) for s in _samplers(2, drop_last=False)]
    assert [len(p) for p in parts] == [51, 51]
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(101))  # full coverage
    assert len(flat) - len(set(flat)) == 1  # one repeated sample pads 101 up to 102


def test_deterministic_per_epoch_and_different_across_epochs():
    a, b = _samplers(2, seed=3)[0], _samplers(2, seed=3)[0]
    assert list(a) == list(b)
    first = list(a)
    a.set_epoch(1)
    b.set_epoch(1)
    assert list(a) == list(b) != first


def test_groups_and_random_level():
    parts = [list(s) for s in _samplers(2, group_size=10, random_level=0.5, drop_last=True)]
    assert sorted(parts[0] + parts[1]) == sorted(set(parts[0] + parts[1]))
    with pytest.raises(ValueError, match="random_level must be in"):
        LoadBalancingDistributedSampler(DATASET, len, world_size=2, rank=0, random_level=2)
    with pytest.raises(ValueError, match="rank must be in"):
        LoadBalancingDistributedSampler(DATASET, len, world_size=2, rank=2)


def _chunks(size):
    return lambda indices: [indices[i:i + size] for i in range(0, len(indices), size)]


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_sampler_gives_every_rank_the_same_number_of_batches(drop_last):
    samplers = _samplers(3, drop_last=True)
    batchers = [LoadBalancingDistributedBatchSampler(s, _chunks(8), drop_last=drop_last) for s in samplers]
    counts = [len(b) for b in batchers]
    assert len(set(counts)) == 1
    for sampler, batcher in zip(samplers, batchers):
        batches = list(batcher)
        mine = set(sampler)
        assert all(set(batch) <= mine for batch in batches)
        lengths = [[len(DATASET[i]) for i in batch] for batch in batches]
        assert all(lengths[k] == sorted(lengths[k]) for k in range(len(lengths)))  # grouped by complexity


def test_batch_sampler_epochs_and_shuffle():
    sampler = _samplers(2, seed=5)[1]
    batcher = LoadBalancingDistributedBatchSampler(sampler, _chunks(4), random_level=1.0)
    first = list(batcher)
    assert list(batcher) == first
    batcher.set_epoch(2)
    assert sampler.epoch == 2 and list(batcher) != first
