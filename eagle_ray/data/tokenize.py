"""Chat conversations -> token rows with an assistant-token loss mask, through the target's chat
template.

What a row loses on the way is counted, never silent: conversations longer than `max_length`
are truncated (or dropped, with `overlong="drop"`), conversations without an assistant token
(none, or all cut off) and conversations the chat template refuses are dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable
from typing import Literal

from eagle_ray.data.chat import NoAssistantTurn, tokenize_conversation

logger = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (token ids, assistant-token loss mask)
Conversation = tuple[str, list[dict[str, str]]]  # (where it came from, messages)


STATUSES = ("kept", "truncated", "dropped_too_long", "dropped_no_answer", "dropped_unrenderable")
TRAINED = ("kept", "truncated")  # statuses of rows that are trained on


def tokenize_row(tokenizer, messages: list[dict[str, str]], max_length: int, vocab_size: int,
                 overlong: Literal["truncate", "drop"], where: str
                 ) -> tuple[str, list[int], list[int]]:
    """`(status, ids, mask)` of one conversation (`STATUSES`): rendered and masked with the chat
    template (`eagle_ray.data.chat`), truncated (or dropped) past `max_length`. A token id outside
    the target's `vocab_size` is an error: the data was tokenised for another model."""
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
    through Ray Data, `eagle_ray.data.ingest`)."""
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
