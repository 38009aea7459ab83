"""The draft vocabulary: the target tokens that occur most often as answer tokens, counted once
per data and target and cached beside the job's output."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from eagle_ray.config.loader import ConfigError
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.tokenize import Row

logger = logging.getLogger(__name__)


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
