"""Token rows -> right-padded micro-batches: packed by a token budget from a window of rows of
like length (what training reads), or fixed-size (the baseline the benchmarks compare with).

A row is `(ids, loss_mask)`, or with images `(ids, loss_mask, pixels, image_sizes)` (its images'
RGB bytes and sizes, `eagle_ray.data.tokenize.tokenize_image_row`); a micro-batch holding any
image is a 4-tuple ending in its `ImageInputs`, every other one the 3-tuple a text job has
always had."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from eagle_ray.contract.images import ImageInputs, MicroBatch
from eagle_ray.data.tokenize import Row


def collate(rows: Iterable[Row | tuple], pad_id: int = 0) -> MicroBatch:
    """Right-pad `(ids, loss_mask)` rows into `input_ids, attention_mask, loss_mask [B, S]`,
    and the images of `(ids, loss_mask, pixels, image_sizes)` rows, if any, into a fourth
    `ImageInputs` (rows in order; text rows hold 0 images)."""
    rows = list(rows)
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    seq = max(len(row[0]) for row in rows)
    input_ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for i, (ids, mask, *_) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask)
    images = collate_images(rows)
    if images is None:
        return input_ids, attention_mask, loss_mask
    return input_ids, attention_mask, loss_mask, images


def collate_images(rows: list) -> ImageInputs | None:
    """The images of `rows` as one `ImageInputs` (`ImageInputs.concat` of each row's); None
    where no row has any."""
    parts = [ImageInputs(torch.from_numpy(np.asarray(row[2], dtype=np.uint8).reshape(-1)),
                         torch.from_numpy(np.asarray(row[3], dtype=np.int64).reshape(-1, 2)),
                         torch.tensor([len(row[3])]))
             if len(row) == 4 and len(row[3]) else None for row in rows]
    return ImageInputs.concat(parts, [1] * len(rows))


def token_budget_micro_batches(rows: Iterable[Row | tuple], max_tokens: int, max_rows: int,
                               window: int = 256, pad_id: int = 0, seed: int = 0
                               ) -> Iterator[MicroBatch]:
    """Right-padded micro-batches of at most `max_tokens` slots (rows x longest row) and
    `max_rows` rows, formed from a window of `window` streamed rows sorted by length, so rows of
    like length share a micro-batch and padding stays small; the window's micro-batches come out
    in a seeded random order. A row longer than `max_tokens` forms a micro-batch alone. Image
    rows count their placeholder tokens (the images' share of the sequence) like any token."""
    rng = random.Random(seed)
    buffer: list = []
    for row in rows:
        buffer.append(row)
        if len(buffer) == window:
            yield from _pack(buffer, max_tokens, max_rows, pad_id, rng)
            buffer = []
    if buffer:
        yield from _pack(buffer, max_tokens, max_rows, pad_id, rng)


def _pack(rows: list, max_tokens: int, max_rows: int, pad_id: int,
          rng: random.Random) -> Iterator[MicroBatch]:
    groups = _group(rows, max_tokens, max_rows, lambda row: len(row[0]))
    rng.shuffle(groups)
    for group in groups:
        yield collate(group, pad_id)


def _group(items: list, max_tokens: int, max_rows: int, length: Callable[[Any], int]
           ) -> list[list]:
    """`items` sorted by `length` and cut into groups of at most `max_rows` whose rows x longest
    stays within `max_tokens` (a longer one alone)."""
    groups: list[list] = [[]]
    for item in sorted(items, key=length):
        group = groups[-1]
        # Sorted by length, so this item is the group's longest.
        if group and ((len(group) + 1) * length(item) > max_tokens or len(group) == max_rows):
            groups.append(group := [])
        group.append(item)
    return groups


def micro_batches_per_epoch(lengths: Sequence[int], max_tokens: int, max_rows: int,
                            window: int, workers: int) -> float:
    """Micro-batches a worker packs from one pass over rows of `lengths` (dealt out evenly to
    `workers`, packed window by window as `token_budget_micro_batches` packs them): what
    `train.epochs` turns into steps (the workers' own shards differ a little)."""
    per_worker = []
    for worker in range(workers):
        shard = list(lengths[worker::workers])
        per_worker.append(sum(len(_group(shard[i:i + window], max_tokens, max_rows, int))
                              for i in range(0, len(shard), window)))
    return sum(per_worker) / max(workers, 1)


def padding_share(micro_batch: MicroBatch) -> float:
    """The share of a micro-batch's slots that are padding."""
    attention = micro_batch[1]
    return 1.0 - float(attention.sum()) / max(attention.numel(), 1)


def make_micro_batches(rows: list[Row | tuple], micro_batch_size: int, pad_id: int = 0,
                       seed: int = 0) -> list[MicroBatch]:
    """Shuffle (seeded) and group rows into fixed-size right-padded micro-batches: the batching
    the job used before token budgets, kept as the baseline `bench ingest` and the tests compare
    `token_budget_micro_batches` with."""
    if not rows:
        raise ValueError("no rows to batch: every conversation was dropped")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [collate([rows[i] for i in order[start:start + micro_batch_size]], pad_id)
            for start in range(0, len(order), micro_batch_size)]
