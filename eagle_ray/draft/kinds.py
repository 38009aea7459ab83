"""The draft kinds a job trains (`draft.kind`), built in one place. What differs per kind
outside its model and objective (the mask token, the captured layers it takes, how vLLM serves
it, its training cost) is its class's attributes; callers ask `draft_class`, never the name."""

from __future__ import annotations

import torch
from torch import nn

from eagle_ray.draft.dflash import ANCHORS_PER_ROW, DECAY, BlockWeighting, DFlashDraft
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.peagle import PEagleDraft

DRAFT_KINDS: dict[str, type[Eagle3Draft] | type[DFlashDraft]] = {
    cls.kind: cls for cls in (Eagle3Draft, PEagleDraft, DFlashDraft)}


def draft_class(kind: str) -> type[Eagle3Draft] | type[DFlashDraft]:
    """The class of draft `kind` (its attributes say how it is trained and served)."""
    try:
        return DRAFT_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown draft kind {kind!r}; choose one of "
                         f"{', '.join(DRAFT_KINDS)}") from None


def build_draft(kind: str, config: DraftConfig, embedding_weight: torch.Tensor | None = None,
                mask_token_id: int | None = None, anchors_per_row: int = ANCHORS_PER_ROW,
                weighting: BlockWeighting = DECAY) -> nn.Module:
    """A freshly initialised draft of `kind` (`mask_token_id` required where it reads one;
    `anchors_per_row` and `weighting` are DFlash's training settings)."""
    cls = draft_class(kind)
    if not cls.reads_mask_token:
        return cls(config, embedding_weight)
    if mask_token_id is None:
        raise ValueError(f"a {kind} draft reads a mask token: pass mask_token_id")
    if cls is DFlashDraft:  # its training settings
        return cls(config, mask_token_id, embedding_weight, anchors_per_row, weighting)
    return cls(config, mask_token_id, embedding_weight)
