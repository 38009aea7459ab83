"""The fixed data order (`eagle_ray.data.order`): every epoch trains every row once, packed as
`token_budget_micro_batches` packs; a run resumed at any position, with the same or another
number of workers, trains exactly what the uninterrupted run trains, in the same order. The
controls: another seed or epoch is another order, and starting the epoch over (what a resume
did with Ray Data's streaming split) trains rows twice."""

import itertools
from collections import Counter

import numpy as np
import pytest

from eagle_ray.config import DataConfig
from eagle_ray.data.micro_batches import token_budget_micro_batches
from eagle_ray.data.order import DataOrder

LENGTHS = np.random.default_rng(0).integers(5, 200, 301)
DATA = DataConfig(max_tokens_per_micro_batch=1024, micro_batch_size=8, shuffle_window=64)


def order(seed: int = 0) -> DataOrder:
    return DataOrder.for_job(LENGTHS, DATA, seed)


def run(order: DataOrder, steps: int, world: int, start: int = 0) -> list[tuple[int, list]]:
    """`(position, row ids)` a run of `world` workers trains in `steps` steps from position
    `start`, in step order, rank order within a step (as the ledger lists them)."""
    shards = [itertools.islice(order.shard(start, rank, world), steps) for rank in range(world)]
    return [item for step in zip(*shards, strict=True) for item in step]


def test_every_epoch_trains_every_row_once_in_token_budget_micro_batches():
    for epoch in range(3):
        micro_batches = order().epoch(epoch)
        assert sorted(i for ids in micro_batches for i in ids) == list(range(len(LENGTHS)))
        assert all(len(ids) <= 8 and len(ids) * max(LENGTHS[ids]) <= 1024
                   for ids in micro_batches)
    # The packing of each window is `token_budget_micro_batches`'s: the same micro-batch count.
    ids = np.random.default_rng([0, 0]).permutation(len(LENGTHS))
    rows = [(list(range(LENGTHS[i])), [1] * int(LENGTHS[i])) for i in ids]
    assert len(order().epoch(0)) == len(list(token_budget_micro_batches(rows, 1024, 8, 64)))


@pytest.mark.parametrize("world,resumed_world", [(2, 2), (2, 1), (1, 3), (3, 2)])
@pytest.mark.parametrize("stop", [1, 5, 23])
def test_a_resume_at_any_position_and_world_continues_the_same_order(world, resumed_world,
                                                                      stop):
    """Stopped after `stop` steps of `world` workers, resumed with `resumed_world`: the ledger
    of the two runs is the uninterrupted run's, micro-batch for micro-batch (stop 23 of two
    workers lies in the second epoch)."""
    uninterrupted = run(order(), 300, world)
    first = run(order(), stop, world)
    resumed = run(order(), 60, resumed_world, start=stop * world)  # epochs 1-4 at least
    assert first + resumed == uninterrupted[:len(first) + len(resumed)]
    assert [p for p, _ in uninterrupted] == list(range(300 * world))

def test_another_seed_or_a_restarted_epoch_is_detected_as_another_order():
    uninterrupted = run(order(), 10, 2)
    assert run(order(seed=1), 10, 2) != uninterrupted, "another seed: another order"
    assert order().epoch(1) != order().epoch(0), "each epoch its own order"
    # A resume that starts the epoch over trains the first five steps' rows twice.
    restarted = run(order(), 5, 2) + run(order(), 5, 2)
    trained = Counter(i for _, ids in restarted for i in ids)
    assert restarted != uninterrupted and max(trained.values()) == 2


def test_fewer_rows_than_workers_still_deals_every_worker_micro_batches():
    small = DataOrder.for_job([10, 20, 30], DATA, 0)
    assert len(small.epoch(0)) == 1
    trained = run(small, 2, 3)
    assert [p for p, _ in trained] == list(range(6)) and all(ids == [0, 1, 2]
                                                             for _, ids in trained)
    with pytest.raises(RuntimeError, match="no training rows"):
        next(DataOrder.for_job([], DATA, 0).shard(0, 0, 1))
