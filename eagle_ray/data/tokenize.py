"""Chat conversations -> token rows with an assistant-token loss mask, through the target's chat
template.

What a row loses on the way is counted, never silent: conversations longer than `max_length`
are truncated (or dropped, with `overlong="drop"`), conversations without an assistant token
(none, or all cut off) and conversations the chat template refuses are dropped. Image-text chats
(`eagle_ray.data.images`) are dropped, named in a warning, when an image is missing or
unreadable, when a cut at `max_length` would fall inside or before an image's placeholder tokens,
or when the target takes no images (`IMAGE_STATUSES`).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from eagle_ray.data.chat import NoAssistantTurn, tokenize_conversation
from eagle_ray.data.images import (
    ImageProblem,
    VisionProcessor,
    describe,
    image_refs,
    load_image,
    no_images,
    text_only,
    tokenize_vision_conversation,
)

logger = logging.getLogger(__name__)

Row = tuple[list[int], list[int]]  # (token ids, assistant-token loss mask)
Conversation = tuple[str, list[dict[str, Any]]]  # (where it came from, messages)
# (status, ids, mask, pixels [P] uint8, image_sizes [I, 2] int64): `images.image_columns`
ImageRow = tuple[str, list[int], list[int], np.ndarray, np.ndarray]


STATUSES = ("kept", "truncated", "dropped_too_long", "dropped_no_answer", "dropped_unrenderable")
# Reported where they occur (and always for a vision-language target's data).
IMAGE_STATUSES = ("dropped_image_missing", "dropped_image_unreadable", "dropped_image_overflow",
                  "dropped_image_unsupported")
ALL_STATUSES = STATUSES + IMAGE_STATUSES
IMAGE_LOAD_DROPS = ("dropped_image_missing", "dropped_image_unreadable")  # named by the job
TRAINED = ("kept", "truncated")  # statuses of rows that are trained on


def tokenize_row(tokenizer, messages: list[dict[str, str]], max_length: int, vocab_size: int,
                 overlong: Literal["truncate", "drop"], where: str
                 ) -> tuple[str, list[int], list[int]]:
    """`(status, ids, mask)` of one conversation (`STATUSES`): rendered and masked with the chat
    template (`eagle_ray.data.chat`), truncated (or dropped) past `max_length`. A token id outside
    the target's `vocab_size` is an error: the data was tokenised for another model. This
    tokenizer takes no images: a conversation with image items is dropped, named."""
    if refs := image_refs(messages):
        logger.warning("%s: dropped (dropped_image_unsupported): image %s, but the target's "
                       "tokenizer takes no images", where, describe(refs[0]))
        return "dropped_image_unsupported", [], []
    try:
        ids, mask = tokenize_conversation(tokenizer, text_only(messages))
    except NoAssistantTurn:
        return "dropped_no_answer", [], []
    except Exception as e:  # jinja2 errors, raise_exception() in templates, alignment
        logger.debug("%s: the chat template refused it: %s", where, e)
        return "dropped_unrenderable", [], []
    _check_vocab(ids, vocab_size, where)
    return _cut(ids, mask, max_length, overlong)


def tokenize_image_row(vision: VisionProcessor, messages: list[dict[str, Any]], max_length: int,
                       vocab_size: int, overlong: Literal["truncate", "drop"], where: str,
                       image_root: str | Path | None = None) -> ImageRow:
    """`tokenize_row` for a vision-language target: images decoded (relative paths against
    `image_root`), resized and expanded as the target's processor does, and returned as RGB
    bytes and sizes (empty for a row without images). A row is never cut inside or before an
    image's placeholder tokens: it is dropped (`dropped_image_overflow`)."""
    none = ([], [], *no_images())
    try:
        images = [load_image(ref, image_root) for ref in image_refs(messages)]
        ids, mask, pixels, sizes = tokenize_vision_conversation(vision, messages, images)
    except ImageProblem as e:
        logger.warning("%s: dropped (%s): %s", where, e.status, e)
        return (e.status, *none)
    except NoAssistantTurn:
        return ("dropped_no_answer", *none)
    except Exception as e:  # jinja2 errors, raise_exception() in templates, alignment
        logger.debug("%s: the chat template refused it: %s", where, e)
        return ("dropped_unrenderable", *none)
    _check_vocab(ids, vocab_size, where)
    placeholders = [i for i, token in enumerate(ids) if token == vision.image_token_id]
    # The last placeholder and the token after it (the image's end marker) must fit.
    if overlong == "truncate" and placeholders and placeholders[-1] + 1 >= max_length \
            and len(ids) > max_length:
        logger.warning("%s: dropped (dropped_image_overflow): its %d tokens (with images "
                       "expanded) pass max_length %d inside or before an image", where,
                       len(ids), max_length)
        return ("dropped_image_overflow", *none)
    status, ids, mask = _cut(ids, mask, max_length, overlong)
    if status not in TRAINED:
        return (status, *none)
    return status, ids, mask, pixels, sizes


def _check_vocab(ids: list[int], vocab_size: int, where: str) -> None:
    if max(ids) >= vocab_size:
        raise ValueError(f"{where}: token id {max(ids)} is outside the target's vocabulary "
                         f"[0, {vocab_size}); the tokenizer does not belong to this target")


def _cut(ids: list[int], mask: list[int], max_length: int,
         overlong: Literal["truncate", "drop"]) -> tuple[str, list[int], list[int]]:
    """`(status, ids, mask)` cut at `max_length` (or dropped), and dropped without an answer."""
    status = "kept"
    if len(ids) > max_length:
        if overlong == "drop":
            return "dropped_too_long", [], []
        ids, mask, status = ids[:max_length], mask[:max_length], "truncated"
    if not any(mask):
        return "dropped_no_answer", [], []
    return status, ids, mask


def job_statuses(statuses: collections.Counter, tokens: int, images: bool,
                 dropped: Sequence[str] = ()) -> dict[str, Any]:
    """What the job reports about its data: every text status, the image ones where they
    occurred (or always, with `images`: a vision-language target's data), the training tokens
    and, with images, the training images and their bytes, and the images of rows dropped for
    them (`dropped_images`: each image and why)."""
    reported = {s: statuses[s] for s in ALL_STATUSES if s in STATUSES or images or statuses[s]}
    if images:
        reported.update({name: statuses[name]
                         for name in ("training_images", "training_image_bytes")})
    return {**reported, "training_tokens": tokens,
            **({"dropped_images": list(dropped)} if dropped else {})}


@dataclasses.dataclass
class TokenizedChats:
    """Tokenised conversations and what happened to each (reported in the job summary)."""

    rows: list[Row]  # or (ids, mask, pixels, image_sizes) rows, with images
    statuses: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def counts(self) -> dict[str, int]:
        """Every text status, and the image ones that occurred."""
        return {status: self.statuses[status] for status in ALL_STATUSES
                if status in STATUSES or self.statuses[status]}


def tokenize_chats(conversations: Iterable[Conversation], tokenizer, max_length: int,
                   vocab_size: int, overlong: Literal["truncate", "drop"] = "truncate",
                   vision: VisionProcessor | None = None, image_root: str | Path | None = None
                   ) -> TokenizedChats:
    """`tokenize_row` (`tokenize_image_row` with `vision`: rows are then `(ids, mask, pixels,
    image_sizes)`) for conversations in memory (tests, small data; the job
    streams them through Ray Data, `eagle_ray.data.ingest`)."""
    out = TokenizedChats(rows=[])
    for where, messages in conversations:
        if vision is None:
            status, *row = tokenize_row(tokenizer, messages, max_length, vocab_size, overlong,
                                        where)
        else:
            status, *row = tokenize_image_row(vision, messages, max_length, vocab_size,
                                              overlong, where, image_root)
        out.statuses[status] += 1
        if status in TRAINED:
            out.rows.append(tuple(row))
    logger.info("tokenised conversations (max_length %d, overlong=%s): %s", max_length,
                overlong, out.counts())
    return out
