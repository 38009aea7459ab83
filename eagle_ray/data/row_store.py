"""The training rows in Ray's object store, read by row id: what the fixed order
(`eagle_ray.data.order`) needs, where Ray Data's streaming split decides at run time which worker
reads which block.

`RowStore.from_dataset` takes the materialised training dataset's blocks as they are (no copy)
and indexes them: one small task per block returns its rows' keys and lengths. A row's id is its
rank among the training rows sorted by conversation key (a content hash), so ids do not depend
on the order in which Ray Data's execution produced the blocks: a rerun over the same data gets
the same ids. Identical conversations share a key and are identical rows, whichever id each
gets. A worker reads a micro-batch's rows with `ray.get` of their blocks: zero-copy on the node
that holds a block; a block on another node is pulled whole (and Ray keeps that copy while the
node's object store has room).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import ray

from eagle_ray.config import DataConfig
from eagle_ray.contract.images import MicroBatch
from eagle_ray.data.micro_batches import collate
from eagle_ray.data.order import DataOrder

ROW_COLUMNS = ("input_ids", "loss_mask")
IMAGE_ROW_COLUMNS = ("pixels", "image_sizes")  # a vision-language target's rows have these too


@ray.remote
def _keys_and_lengths(block) -> tuple[np.ndarray, np.ndarray]:
    from ray.data.block import BlockAccessor

    columns = BlockAccessor.for_block(block).to_numpy(["key", "length"])
    return np.asarray(columns["key"], dtype=str), np.asarray(columns["length"], dtype=np.int64)


@dataclasses.dataclass(frozen=True)
class RowStore:
    """The training rows' blocks and, per row id, the block and the row in it that hold it."""

    blocks: list[Any]  # ObjectRefs of the materialised dataset's blocks
    block_of: np.ndarray  # row id -> index into `blocks`
    offset: np.ndarray  # row id -> the row's index in its block
    lengths: np.ndarray  # row id -> tokens
    columns: tuple[str, ...]  # what a row tuple holds (`ROW_COLUMNS`, then any image columns)
    digest: str  # of the sorted keys: whether a resumed run reads the same rows

    @classmethod
    def from_dataset(cls, dataset, cpus_per_task: float = 0.1) -> RowStore:
        """Index a materialised Ray Dataset of training rows (`key`, `length`, `ROW_COLUMNS`
        and, for a vision-language target, `IMAGE_ROW_COLUMNS`)."""
        blocks = [ref for bundle in dataset.iter_internal_ref_bundles()
                  for ref in bundle.block_refs]
        parts = ray.get([_keys_and_lengths.options(num_cpus=cpus_per_task).remote(ref)
                         for ref in blocks])
        sizes = [len(k) for k, _ in parts]
        keys = np.concatenate([k for k, _ in parts] + [np.array([], dtype=str)])
        by_key = np.argsort(keys, kind="stable")
        block_of = np.repeat(np.arange(len(parts), dtype=np.int64), sizes)
        offset = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes]
                                + [np.zeros(0, np.int64)])
        lengths = np.concatenate([n for _, n in parts] + [np.zeros(0, np.int64)])
        schema = dataset.schema()  # None: no rows (`DataOrder.shard` says so)
        names = set(schema.names) if schema is not None else set()
        columns = ROW_COLUMNS + tuple(c for c in IMAGE_ROW_COLUMNS if c in names)
        digest = hashlib.sha1("\n".join(keys[by_key].tolist()).encode()).hexdigest()
        return cls(blocks, block_of[by_key], offset[by_key], lengths[by_key], columns, digest)

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, ids: Sequence[int]) -> list[tuple]:
        """The rows of `ids`, in that order, as the tuples `collate` takes."""
        from ray.data.block import BlockAccessor

        ids = np.asarray(ids, dtype=np.int64)
        wanted = sorted(set(self.block_of[ids].tolist()))
        found: dict[int, tuple] = {}
        for b, block in zip(wanted, ray.get([self.blocks[b] for b in wanted]), strict=True):
            mine = ids[self.block_of[ids] == b]
            batch = BlockAccessor.for_block(BlockAccessor.for_block(block).take(
                self.offset[mine].tolist())).to_batch_format("numpy")
            for i, row in zip(mine.tolist(), zip(*[batch[c] for c in self.columns],
                                                 strict=True), strict=True):
                found[i] = row
        return [found[i] for i in ids.tolist()]

    def order(self, data: DataConfig, seed: int) -> DataOrder:
        """The order a job with `data`'s packing settings and `seed` trains these rows in."""
        return DataOrder.for_job(self.lengths, data, seed)

    def epoch_micro_batches(self, order: DataOrder, epoch: int = 0, pad_id: int = 0
                            ) -> Iterator[MicroBatch]:
        """Epoch `epoch`'s micro-batches in `order`, all of them, one pass (what a supervision
        cache holds)."""
        for ids in order.epoch(epoch):
            yield collate(self.rows(ids), pad_id)

    def micro_batches(self, order: DataOrder, start: int, rank: int, world: int,
                      pad_id: int = 0) -> Iterator[tuple[int, list[int], MicroBatch]]:
        """`(position, row ids, micro-batch)` of worker `rank` of `world` from global position
        `start` on (`DataOrder.shard`), for as long as asked."""
        for position, ids in order.shard(start, rank, world):
            yield position, ids, collate(self.rows(ids), pad_id)
