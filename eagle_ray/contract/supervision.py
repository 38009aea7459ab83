"""Draft vocabulary and the draft-side view of any target encoding (docs/contract.md,
"Encodings" and "Draft vocabulary").

Whatever encoding a backend ships (full `logits`, `last_hidden`, or `target_probs`), the trainer
turns it into the same two tensors here: the target's distribution renormalised over the draft
vocabulary, and a mask of positions whose full-vocabulary argmax the draft can express at all.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle_ray.contract.losses import FORWARD_KL
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.devices import hand_over

if TYPE_CHECKING:
    from eagle_ray.contract.target_head import TargetHead

# Tokens per chunk when decoding last_hidden through the full-vocabulary head: bounds the
# transient [chunk, V] logits (128k vocab x 4096 tokens x 4 B = 2 GiB at most).
HEAD_CHUNK_TOKENS = 4096


@dataclasses.dataclass(frozen=True)
class DraftVocab:
    """The draft's reduced vocabulary as ascending target token ids.

    `d2t` is vLLM's offset form (`target_id = draft_id + d2t[draft_id]`); `t2d` marks the target
    ids the draft can emit.

    Example:
        >>> vocab = DraftVocab.from_token_counts(torch.tensor([5, 0, 9, 1]), draft_vocab_size=2)
        >>> vocab.draft_to_target.tolist(), vocab.d2t.tolist(), vocab.t2d.tolist()
        ([0, 2], [0, 1], [True, False, True, False])
    """

    draft_to_target: torch.Tensor  # [V_draft] int64, ascending target ids
    target_vocab_size: int

    def __post_init__(self) -> None:
        ids = self.draft_to_target
        if ids.dim() != 1 or ids.numel() == 0 or ids.dtype != torch.int64:
            raise ValueError(f"draft_to_target must be a non-empty 1-D int64 tensor, got "
                             f"{ids.dtype} {list(ids.shape)}")
        if ids.min() < 0 or ids.max() >= self.target_vocab_size:
            raise ValueError(f"draft_to_target ids must be in [0, {self.target_vocab_size})")
        if ids.numel() > 1 and not torch.all(ids[1:] > ids[:-1]):
            raise ValueError("draft_to_target must be strictly ascending (distinct target ids)")

    @classmethod
    def from_token_counts(cls, counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
        """The `draft_vocab_size` most frequent target tokens (ties broken by lower id)."""
        if not 0 < draft_vocab_size <= counts.numel():
            raise ValueError(f"draft_vocab_size must be in [1, {counts.numel()}], "
                             f"got {draft_vocab_size}")
        order = torch.argsort(counts.to(torch.float64), descending=True, stable=True)
        chosen = torch.sort(order[:draft_vocab_size]).values
        return cls(chosen.to(torch.int64), counts.numel())

    @classmethod
    def from_target_ids(cls, ids: Iterable[int], target_vocab_size: int) -> DraftVocab:
        return cls(torch.tensor(sorted(set(ids)), dtype=torch.int64), target_vocab_size)

    @property
    def size(self) -> int:
        return self.draft_to_target.numel()

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_to_target - torch.arange(self.size)

    @property
    def t2d(self) -> torch.Tensor:
        mask = torch.zeros(self.target_vocab_size, dtype=torch.bool)
        mask[self.draft_to_target] = True
        return mask

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"target_vocab_size": self.target_vocab_size,
                                          "draft_to_target": self.draft_to_target.tolist()}))

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        data = json.loads(Path(path).read_text())
        return cls(torch.tensor(data["draft_to_target"], dtype=torch.int64),
                   int(data["target_vocab_size"]))


@torch.no_grad()  # targets, never trained through
def draft_target_from_logits(
    logits: torch.Tensor, vocab: DraftVocab
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(probs [..., V_draft] fp32, position_mask [...] bool)` from full-vocabulary logits."""
    if logits.shape[-1] != vocab.target_vocab_size:
        raise ValueError(f"logits have {logits.shape[-1]} classes, the draft vocabulary maps "
                         f"into {vocab.target_vocab_size}")
    position_mask = vocab.t2d.to(logits.device).take(logits.argmax(dim=-1))
    selected = logits.index_select(-1, vocab.draft_to_target.to(logits.device)).float()
    return torch.softmax(selected, dim=-1), position_mask


@torch.no_grad()
def head_logits(last_hidden: torch.Tensor, head: TargetHead,
                device: torch.device | str | None = None) -> torch.Tensor:
    """`head(last_hidden)` `[..., V]`, computed on the head's device in token chunks and
    assembled on `device` (default: where `last_hidden` is): the full-vocabulary logits never
    exist on the head's device for more than one chunk."""
    return _decode_in_chunks(last_hidden, head, device, lambda logits: (logits,))[0]


@torch.no_grad()
def draft_target_from_hidden(
    last_hidden: torch.Tensor, head: TargetHead, vocab: DraftVocab,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like `draft_target_from_logits`, decoding `last_hidden [..., H]` through the target head
    in token chunks (on the head's device), assembled on `device` (default: `last_hidden`'s)."""
    return _decode_in_chunks(last_hidden, head, device,
                             lambda logits: draft_target_from_logits(logits, vocab))


def _decode_in_chunks(last_hidden: torch.Tensor, head: TargetHead,
                      device: torch.device | str | None, decode) -> tuple[torch.Tensor, ...]:
    device = last_hidden.device if device is None else torch.device(device)
    head_device = head.lm_head.weight.device
    lead = last_hidden.shape[:-1]
    flat = last_hidden.reshape(-1, last_hidden.shape[-1])
    # Each chunk's results leave the head's device as soon as they exist (its memory is reused
    # by the next chunk); `hand_over` returns once every copy has landed.
    chunks = flat.split(HEAD_CHUNK_TOKENS)
    parts = hand_over((part for chunk in chunks
                       for part in decode(head(hand_over([chunk], head_device)[0]))), device)
    per_chunk = len(parts) // len(chunks)  # decode's outputs, interleaved chunk by chunk
    outputs = [parts[i] if len(chunks) == 1 else torch.cat(parts[i::per_chunk])
               for i in range(per_chunk)]
    return tuple(out.reshape(*lead, *out.shape[1:]) for out in outputs)


def draft_target(
    batch: Eagle3TargetBatch, vocab: DraftVocab, head: TargetHead | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draft-vocabulary target probabilities and position mask from a batch in any encoding."""
    if batch.encoding == "logits":
        return draft_target_from_logits(batch.logits, vocab)
    if batch.encoding == "last_hidden":
        if head is None:
            raise ValueError("decoding the last_hidden encoding needs the target head "
                             "(backend.get_target_head())")
        return draft_target_from_hidden(batch.last_hidden, head, vocab)
    if batch.target_probs.shape[-1] != vocab.size:
        raise ValueError(f"batch target_probs cover {batch.target_probs.shape[-1]} draft tokens, "
                         f"the draft vocabulary has {vocab.size}")
    return batch.target_probs.float(), batch.position_mask


def soft_cross_entropy(
    draft_logits: torch.Tensor,
    target_probs: torch.Tensor,
    position_mask: torch.Tensor,
    loss_mask: torch.Tensor,
) -> torch.Tensor:
    """Mean soft cross-entropy over slots where both `loss_mask` and `position_mask` hold
    (`train.loss: forward_kl`, the default; the others are in `contract/losses.py`)."""
    return FORWARD_KL.mean(draft_logits, target_probs, position_mask, loss_mask)
