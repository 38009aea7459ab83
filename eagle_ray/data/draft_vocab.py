"""The draft vocabulary: the target tokens that occur most often as answer tokens, counted once
per data and target and cached beside the job's output."""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import torch

from eagle_ray.config.loader import ConfigError
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.tokenize import TRAINED, Row

logger = logging.getLogger(__name__)

DROPPED_NAMED = 20  # rows dropped for their images that the job names (the rest are counted)


def answer_token_counts(rows: Iterable[Row], vocab_size: int) -> torch.Tensor:
    """How often each target token occurs as an answer (loss-masked) token."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for ids, mask in rows:
        answer = torch.tensor([t for t, m in zip(ids, mask, strict=True) if m], dtype=torch.long)
        counts += torch.bincount(answer, minlength=vocab_size)
    return counts


def load_or_build_draft_vocab(path: str | Path, source: dict,
                              count: Callable[[], tuple[torch.Tensor, dict[str, int]]],
                              vocab_size: int, draft_vocab_size: int
                              ) -> tuple[DraftVocab, dict[str, int]]:
    """The draft vocabulary and the data counts cached at `path` for this `source` (what the
    data and target were); otherwise `count()` (answer-token counts, statuses) runs and the
    `draft_vocab_size` most frequent answer tokens are cached. `vocab_size` is the target
    checkpoint's (padded) vocabulary; `draft_vocab_size == vocab_size` is a full-vocabulary
    draft."""
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"data.draft_vocab_size {draft_vocab_size} exceeds the target's "
                          f"vocabulary ({vocab_size}); set it to at most {vocab_size} "
                          f"({vocab_size} gives a full-vocabulary draft)")
    path = Path(path)
    if path.exists():
        cached = json.loads(path.read_text())
        vocab = DraftVocab.load(path)
        if cached.get("source") == source and vocab.size == draft_vocab_size \
                and vocab.target_vocab_size == vocab_size:
            logger.info("reusing draft vocabulary %s (%d tokens)", path, vocab.size)
            return vocab, cached["statuses"]
    counts, statuses = count()
    vocab = DraftVocab.from_token_counts(counts, draft_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab.save(path)
    path.write_text(json.dumps({**json.loads(path.read_text()), "source": source,
                                "statuses": statuses}))
    logger.info("built draft vocabulary of %d tokens -> %s", vocab.size, path)
    return vocab, statuses


def count_answers(tokenized_dataset, held_out_keys: Iterable[str], vocab_size: int,
                  images: bool = False
                  ) -> tuple[np.ndarray, collections.Counter, int, list[str]]:
    """One streaming pass on the driver: answer-token counts over the training rows (for the
    draft vocabulary), what happened to every conversation (`ALL_STATUSES`), the training
    rows' tokens, and why rows were dropped for their images (`DROPPED_NAMED` at most: each
    image and its reason). `images`: the rows have image columns; the pass reads their sizes
    (never their pixels) and counts the training rows' `training_images` and their bytes
    (`training_image_bytes`) among the statuses."""
    excluded = frozenset(held_out_keys)
    counts = np.zeros(vocab_size, dtype=np.int64)
    statuses: collections.Counter = collections.Counter()
    tokens = 0
    dropped: list[str] = []
    names = ["status", "key", "input_ids", "loss_mask"] + (["image_sizes", "problem"] if images
                                                            else [])
    rows = tokenized_dataset.select_columns(names) if images else tokenized_dataset
    for batch in rows.iter_batches(batch_size=256, batch_format="numpy"):
        nothing = [None] * len(batch["status"])
        sizes = batch["image_sizes"] if images else nothing
        problems = batch["problem"] if images else nothing
        for status, key, ids, mask, size, problem in zip(
                batch["status"], batch["key"], batch["input_ids"], batch["loss_mask"], sizes,
                problems, strict=True):
            if key in excluded:
                continue
            statuses[str(status)] += 1
            if problem and len(dropped) < DROPPED_NAMED:
                dropped.append(str(problem))
            if status in TRAINED:
                counts += np.bincount(ids[mask == 1], minlength=vocab_size)
                tokens += len(ids)
                if size is not None:
                    statuses["training_images"] += len(size)
                    statuses["training_image_bytes"] += 3 * int(np.prod(size, axis=1).sum())
    return counts, statuses, tokens, dropped
