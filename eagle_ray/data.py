"""Chat conversations -> right-padded micro-batches with an assistant-token loss mask, and the
draft vocabulary built from the answer tokens.

What a row loses on the way is counted, never silent: conversations longer than `max_length`
are truncated (or dropped, with `overlong="drop"`), conversations without an assistant token
(none, or all cut off) and conversations the chat template refuses are dropped.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

import torch

from eagle_ray.chat import NoAssistantTurn, read_conversations, tokenize_conversation
from eagle_ray.config.loader import ConfigError
from eagle_ray.supervision import DraftVocab

logger = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (token ids, assistant-token loss mask)
Conversation = tuple[str, list[dict[str, str]]]  # (where it came from, messages)


def load_conversations(path: str | Path | None, num_samples: int) -> list[Conversation]:
    """The conversations of a chat JSONL file (`eagle_ray.chat.read_conversations`), or
    `num_samples` of the built-in generated chat data when `path` is None."""
    if path is not None:
        return list(read_conversations(path))
    from eagle_ray.tiny import generate_chat_samples

    return [(f"generated:{i}", sample["messages"])
            for i, sample in enumerate(generate_chat_samples(num_samples))]


def collate(rows: Iterable[Row], pad_id: int = 0
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
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


@dataclasses.dataclass
class TokenizedChats:
    """Tokenised conversations and what happened on the way (reported in the job summary)."""

    rows: list[Row]
    truncated: int = 0  # longer than max_length, cut to it
    dropped_too_long: int = 0  # longer than max_length, dropped (overlong="drop")
    dropped_no_answer: int = 0  # no assistant token (none, or all past the cut)
    dropped_unrenderable: int = 0  # the chat template raised (e.g. roles not alternating)

    def counts(self) -> dict[str, int]:
        return {"kept": len(self.rows), **{k: v for k, v in dataclasses.asdict(self).items()
                                           if k != "rows"}}


def tokenize_chats(conversations: Iterable[Conversation], tokenizer, max_length: int,
                   vocab_size: int, overlong: Literal["truncate", "drop"] = "truncate"
                   ) -> TokenizedChats:
    """Tokenise conversations with the chat template (`eagle_ray.chat`), truncating (or dropping)
    rows over `max_length` tokens. A token id outside the target's `vocab_size` is an error: the
    data was tokenised for another model."""
    out = TokenizedChats(rows=[])
    first_template_error = None
    for where, messages in conversations:
        try:
            ids, mask = tokenize_conversation(tokenizer, messages)
        except NoAssistantTurn:
            out.dropped_no_answer += 1
            continue
        except Exception as e:  # jinja2 errors, raise_exception() in templates, alignment
            out.dropped_unrenderable += 1
            first_template_error = first_template_error or f"{where}: {e}"
            continue
        if max(ids) >= vocab_size:
            raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary "
                             f"[0, {vocab_size}); the tokenizer does not belong to this target")
        if len(ids) > max_length:
            if overlong == "drop":
                out.dropped_too_long += 1
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            out.truncated += 1
        if not any(mask):
            out.dropped_no_answer += 1
            continue
        out.rows.append((ids, mask))
    if first_template_error:
        logger.warning("the chat template refused %d conversations; the first: %s",
                       out.dropped_unrenderable, first_template_error)
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


def load_or_build_draft_vocab(path: str | Path, rows: list[Row], vocab_size: int,
                              draft_vocab_size: int) -> DraftVocab:
    """The draft vocabulary cached at `path`; built from answer-token counts when absent or
    when it was built for other sizes. `vocab_size` is the target checkpoint's (padded)
    vocabulary; `draft_vocab_size == vocab_size` is a full-vocabulary draft."""
    if draft_vocab_size > vocab_size:
        raise ConfigError(f"data.draft_vocab_size {draft_vocab_size} exceeds the target's "
                          f"vocabulary ({vocab_size}); set it to at most {vocab_size} "
                          f"({vocab_size} gives a full-vocabulary draft)")
    path = Path(path)
    if path.exists():
        vocab = DraftVocab.load(path)
        if vocab.size == draft_vocab_size and vocab.target_vocab_size == vocab_size:
            logger.info("reusing draft vocabulary %s (%d tokens)", path, vocab.size)
            return vocab
    vocab = DraftVocab.from_token_counts(answer_token_counts(rows, vocab_size), draft_vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    vocab.save(path)
    logger.info("built draft vocabulary of %d tokens -> %s", vocab.size, path)
    return vocab


def make_micro_batches(rows: list[Row], micro_batch_size: int, pad_id: int = 0, seed: int = 0
                       ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Shuffle (seeded) and group rows into right-padded micro-batches."""
    if not rows:
        raise ValueError("no rows to batch: every conversation was dropped (see the counts "
                         "logged by tokenize_chats)")
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    return [collate([rows[i] for i in order[start:start + micro_batch_size]], pad_id)
            for start in range(0, len(order), micro_batch_size)]
