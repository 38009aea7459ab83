"""The draft kinds a job trains (`draft.kind`), built in one place."""

from __future__ import annotations

import torch
from torch import nn

from eagle_ray.draft.dflash import ANCHORS_PER_ROW, DFlashDraft
from eagle_ray.draft.model import DraftConfig, Eagle3Draft
from eagle_ray.draft.peagle import PEagleDraft

DRAFT_KINDS = ("eagle3", "peagle", "dflash")


def uses_mask_token(kind: str) -> bool:
    """Whether a kind's drafted slots read a mask token (all but EAGLE-3's chain)."""
    return kind != "eagle3"


def build_draft(kind: str, config: DraftConfig, embedding_weight: torch.Tensor | None = None,
                mask_token_id: int | None = None, anchors_per_row: int = ANCHORS_PER_ROW,
                decay_gamma: float | None = None) -> nn.Module:
    """A freshly initialised draft of `kind` (`mask_token_id` required where it reads one;
    `anchors_per_row` and `decay_gamma` are DFlash's training settings)."""
    if kind not in DRAFT_KINDS:
        raise ValueError(f"unknown draft kind {kind!r}; choose one of {', '.join(DRAFT_KINDS)}")
    if kind == "eagle3":
        return Eagle3Draft(config, embedding_weight)
    if mask_token_id is None:
        raise ValueError(f"a {kind} draft reads a mask token: pass mask_token_id")
    if kind == "peagle":
        return PEagleDraft(config, mask_token_id, embedding_weight)
    return DFlashDraft(config, mask_token_id, embedding_weight, anchors_per_row, decay_gamma)
