"""What each step trained, row by row (`rows.jsonl`), and where a resumed run continues the data.

A job's data order is fixed (`eagle_ray.data.order`): a global sequence of micro-batches whose
index is the *position*; a step of `W` workers trains `W` consecutive positions. Every checkpoint
saves the next position (`POSITION_FILE`), and a resumed run, at any number of workers, continues
there.

The ledger is how a run shows it: `<output_dir>/rows.jsonl`, one line per step,
`{"step": s, "positions": [p, ...], "rows": [[row id, ...], ...]}` with one entry per worker in
rank order (the rows of its micro-batch: `eagle_ray.data.row_store` ids; a job reading a
supervision cache lists the cache's micro-batch keys under `"cached"` instead of `"rows"`). Each
worker notes what it trained; at every logged step the notes are gathered on rank 0 (one
`all_gather_object` of ids), which appends them. A worker group that restarts from a checkpoint
first drops the lines after its step, as metrics.jsonl does: the file then holds what the run's
draft has learned from, each step once.
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LEDGER_FILE = "rows.jsonl"
POSITION_FILE = "data_position.json"  # in a checkpoint: the next position, and what it counts


class RowLedger:
    """One worker's notes of the micro-batches it trains, written by rank 0 for all workers."""

    def __init__(self, output_dir: str | Path, rank: int, world: int, start_step: int,
                 start_position: int, field: str = "rows") -> None:
        self.path = Path(output_dir) / LEDGER_FILE
        self.rank, self.world, self.field = rank, world, field
        self.start_step, self.start_position = start_step, start_position
        self.pending: collections.deque[tuple[int, list[Any]]] = collections.deque()
        self.trained: list[tuple[int, int, list[Any]]] = []  # (step, position, ids) unwritten

    def tagged(self, micro_batches: Iterator[tuple[int, list[Any], Any]]) -> Iterator[Any]:
        """The micro-batches of `(position, ids, micro-batch)`, their ids noted in order
        (they are trained in the order they are read, after the prefetch window)."""
        for position, ids, micro_batch in micro_batches:
            self.pending.append((position, list(ids)))
            yield micro_batch

    def trained_step(self, step: int) -> None:
        """The oldest micro-batch read has just been trained, as step `step`."""
        position, ids = self.pending.popleft()
        self.trained.append((step, position, ids))

    def position(self, step: int) -> int:
        """The global position the run continues from after `step` steps."""
        return self.start_position + (step - self.start_step) * self.world

    def started(self) -> None:
        """The worker group (re)started at `start_step`: rank 0 drops later lines."""
        if self.rank == 0 and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if json.loads(line)["step"] <= self.start_step]
            self.path.write_text("".join(f"{line}\n" for line in kept))

    def write(self) -> None:
        """Gather every worker's notes on rank 0 and append them (every rank calls this at the
        same steps: a collective)."""
        notes = [self.trained]
        if self.world > 1:
            import torch.distributed as dist

            notes = [None] * self.world
            dist.all_gather_object(notes, self.trained)
        self.trained = []
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            for per_rank in zip(*notes, strict=True):
                f.write(json.dumps({"step": per_rank[0][0],
                                    "positions": [position for _, position, _ in per_rank],
                                    self.field: [ids for _, _, ids in per_rank]}) + "\n")


def save_position(directory: Path, position: int, digest: str | None) -> None:
    """Write the next position (and the digest of the rows it counts in) into a checkpoint."""
    (Path(directory) / POSITION_FILE).write_text(json.dumps({"position": position,
                                                             "rows_digest": digest}))


def resumed_position(checkpoint, step: int, world: int, digest: str | None) -> int:
    """Where a run resumed from `checkpoint` at `step` continues the data order (0 without a
    checkpoint). A checkpoint written before positions were saved continues at `step * world`
    (as if it had `world` workers); one over other rows (another digest) continues by position
    over the rows there are now, which is not the order it began."""
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as ckpt_dir:
        path = Path(ckpt_dir) / POSITION_FILE
        saved = json.loads(path.read_text()) if path.exists() else None
    if saved is None:
        logger.warning("the checkpoint at step %d records no data position: the data order "
                       "continues at position %d", step, step * world)
        return step * world
    if saved["rows_digest"] != digest:
        logger.warning("the training rows differ from those the checkpoint at step %d was "
                       "trained on: the order continues at position %d over these rows, not "
                       "the order the run began", step, saved["position"])
    return saved["position"]
