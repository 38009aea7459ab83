"""Chat conversations -> right-padded micro-batches with an assistant-token loss mask, and the
draft vocabulary built from the answer tokens.

What a row loses on the way is counted, never silent: conversations longer than `max_length`
are truncated (or dropped, with `overlong="drop"`), conversations without an assistant token
(none, or all cut off) and conversations the chat template refuses are dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import torch

from eagle_ray.chat import NoAssistantTurn, tokenize_conversation
from eagle_ray.config.loader import ConfigError
from eagle_ray.supervision import DraftVocab

logger = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (token ids, assistant-token loss mask)
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, attention, loss [B, S]
Conversation = tuple[str, list[dict[str, str]]]  # (where it came from, messages)


def collate(rows: Iterable[Row], pad_id: int = 0) -> MicroBatch:
    """Right-pad `(ids, loss_mask)` rows into `input_ids, attention_mask, loss_mask [B, S]`."""
    rows = list(rows)
    if not rows:
        raise ValueError("cannot collate an empty list of rows")
    seq = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), seq), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    loss_mask = torch.zeros((len(rows), seq), dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        loss_mask[i, : len(ids)] = torch.tensor(mask)
    return input_ids, attention_mask, loss_mask


STATUSES = ("kept", "truncated", "dropped_too_long", "dropped_no_answer", "dropped_unrenderable")
TRAINED = ("kept", "truncated")  # statuses of rows that are trained on


def tokenize_row(tokenizer, messages: list[dict[str, str]], max_length: int, vocab_size: int,
                 overlong: Literal["truncate", "drop"], where: str
                 ) -> tuple[str, list[int], list[int]]:
    """`(status, ids, mask)` of one conversation (`STATUSES`): rendered and masked with the chat
    template (`eagle_ray.chat`), truncated (or dropped) past `max_length`. A token id outside the
    target's `vocab_size` is an error: the data was tokenised for another model."""
    try:
        ids, mask = tokenize_conversation(tokenizer, messages)
    except NoAssistantTurn:
        return "dropped_no_answer", [], []
    except Exception as e:  # jinja2 errors, raise_exception() in templates, alignment
        logger.debug("%s: the chat template refused it: %s", where, e)
        return "dropped_unrenderable", [], []
    if max(ids) >= vocab_size:
        raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary "
                         f"[0, {vocab_size}); the tokenizer does not belong to this target")
    status = "kept"
    if len(ids) > max_length:
        if overlong == "drop":
            return "dropped_too_long", [], []
        ids, mask, status = ids[:max_length], mask[:max_length], "truncated"
    if not any(mask):
        return "dropped_no_answer", [], []
    return status, ids, mask


@dataclasses.dataclass
class TokenizedChats:
    """Tokenised conversations and what happened to each (reported in the job summary)."""

    rows: list[Row]
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def counts(self) -> dict[str, int]:
        return {status: self.statuses[status] for status in STATUSES}


def tokenize_chats(conversations: Iterable[Conversation], tokenizer, max_length: int,
                   vocab_size: int, overlong: Literal["truncate", "drop"] = "truncate"
                   ) -> TokenizedChats:
    """`tokenize_row` for conversations in memory (tests, small data; the job streams them
    through Ray Data, `eagle_ray.ingest`)."""
    out = TokenizedChats(rows=[])
    for where, messages in conversations:
        status, ids, mask = tokenize_row(tokenizer, messages, max_length, vocab_size, overlong,
                                         where)
        out.statuses[status] += 1
        if status in TRAINED:
            out.rows.append((ids, mask))
    logger.info("tokenised conversations (max_length %d, overlong=%s): %s", max_length,
                overlong, out.counts())
    return out


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


def token_budget_micro_batches(rows: Iterable[Row], max_tokens: int, max_rows: int,
                               window: int = 256, pad_id: int = 0, seed: int = 0
                               ) -> Iterator[MicroBatch]:
    """Right-padded micro-batches of at most `max_tokens` slots (rows x longest row) and
    `max_rows` rows, formed from a window of `window` streamed rows sorted by length, so rows of
    like length share a micro-batch and padding stays small; the window's micro-batches come out
    in a seeded random order. A row longer than `max_tokens` forms a micro-batch alone."""
    rng = random.Random(seed)
    buffer: list[Row] = []
    for row in rows:
        buffer.append(row)
        if len(buffer) == window:
            yield from _pack(buffer, max_tokens, max_rows, pad_id, rng)
            buffer = []
    if buffer:
        yield from _pack(buffer, max_tokens, max_rows, pad_id, rng)


def _pack(rows: list[Row], max_tokens: int, max_rows: int, pad_id: int,
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


def make_micro_batches(rows: list[Row], micro_batch_size: int, pad_id: int = 0, seed: int = 0
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Shuffle (seeded) and group rows into fixed-size right-padded micro-batches: the batching
    the job used before token budgets, kept as the baseline `bench ingest` and the tests compare
    `token_budget_micro_batches` with."""
    if not rows:
        raise ValueError("no rows to batch: every conversation was dropped")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [collate([rows[i] for i in order[start:start + micro_batch_size]], pad_id)
            for start in range(0, len(order), micro_batch_size)]
