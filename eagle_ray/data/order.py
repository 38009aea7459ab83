"""The training data's order, fixed by row ids, the seed and the epoch: what makes a resume exact.

Ray Data's streaming split hands each block to whichever worker asks next, so which rows a worker
trains, and in what order, is decided at run time and cannot be replayed; a resumed run could
only start its epoch again. Here the order is a pure function instead: epoch `e`'s rows are a
permutation of the row ids seeded by `(train.seed, e)`, cut into windows of
`data.shuffle_window` rows, each window sorted by length and packed into token-budget
micro-batches (`length_groups`, as `token_budget_micro_batches` packs), the window's
micro-batches in a seeded order. The epochs' micro-batches, one after the other, form one global
sequence; its index is the *position*. A step of `W` workers trains `W` consecutive positions,
worker `w` the `w`-th of them, so a checkpoint needs only the next position, and a run resumed
with any number of workers deals out the positions left to its own workers: no micro-batch is
trained twice and none is skipped.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import numpy as np

from eagle_ray.config import DataConfig
from eagle_ray.data.micro_batches import length_groups

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, eq=False)
class DataOrder:
    """The global sequence of micro-batches (each a list of row ids) over rows of `lengths`
    (tokens per row id), epoch after epoch."""

    lengths: np.ndarray
    seed: int
    max_tokens: int
    max_rows: int
    window: int

    @classmethod
    def for_job(cls, lengths: Sequence[int] | np.ndarray, data: DataConfig, seed: int
                ) -> DataOrder:
        """The order a job with `data`'s packing settings and `train.seed` trains in."""
        return cls(np.asarray(lengths, dtype=np.int64), seed, data.max_tokens_per_micro_batch,
                   data.micro_batch_size, data.shuffle_window)

    def epoch(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s micro-batches, in training order, as lists of row ids."""
        ids = np.random.default_rng([self.seed % 2**32, epoch]).permutation(len(self.lengths))
        shuffle = random.Random(self.seed * 1000 + epoch)
        micro_batches: list[list[int]] = []
        for start in range(0, len(ids), self.window):
            groups = length_groups(ids[start:start + self.window].tolist(), self.max_tokens,
                                   self.max_rows, self.lengths.__getitem__)
            shuffle.shuffle(groups)
            micro_batches.extend(groups)
        return micro_batches

    def shard(self, start: int, rank: int, world: int) -> Iterator[tuple[int, list[int]]]:
        """`(position, row ids)` of what worker `rank` of `world` trains from global position
        `start` on: positions `start + rank`, then every `world`-th, for as long as asked."""
        if not len(self.lengths):
            raise RuntimeError("no training rows: every conversation was dropped or held out")
        return shard(self.epoch, start, rank, world)


def shard(epoch: Callable[[int], Sequence[T]], start: int, rank: int, world: int
          ) -> Iterator[tuple[int, T]]:
    """`(position, item)` for positions `start + rank + k * world` of the sequence that
    `epoch(0)`, `epoch(1)`, ... form one after the other (each epoch non-empty)."""
    position, first = start + rank, 0
    for e in itertools.count():
        items = epoch(e)
        while position < first + len(items):
            yield position, items[position - first]
            position += world
        first += len(items)
