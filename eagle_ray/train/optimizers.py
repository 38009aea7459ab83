"""The learner's optimizers (`train.optimizer`) and their warm-up + cosine schedule.

`adamw`: one AdamW over every trained weight. `muon`: torch's `Muon` (momentum orthogonalised by
Newton-Schulz iterations; Keller Jordan, "Muon: An optimizer for hidden layers in neural
networks", 2024) over the draft's 2-D weight matrices and AdamW over the rest, split as
speculators 0.9 splits them (`speculators/train/optimizers.py`, `split_named_params_for_muon`):
a trained parameter goes to Muon iff it is 2-D with both sides > 1 and is no embedding or output
head (`embed_tokens`, `lm_head`: Muon's convention); norms, vectors such as P-EAGLE's
`mask_hidden`, and the draft-vocabulary `lm_head` go to AdamW. Every optimizer follows the same
schedule factor, each from its own learning rate.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from eagle_ray.config import TrainConfig

logger = logging.getLogger(__name__)

# Names of 2-D weights AdamW keeps (speculators' `_ADAMW_NAME_HINTS` that a draft here has).
ADAMW_MATRICES = ("embed_tokens", "lm_head")


def muon_split(model: torch.nn.Module
               ) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(Muon's parameters, AdamW's): the trained ones, split as speculators splits them."""
    muon, adamw = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        matrix = param.ndim == 2 and min(param.shape) > 1
        (muon if matrix and not any(h in name for h in ADAMW_MATRICES) else adamw).append(param)
    return muon, adamw


def build_optimizers(model: torch.nn.Module, train: TrainConfig) -> list[torch.optim.Optimizer]:
    """`train.optimizer`'s optimizers over `model`'s trained parameters (AdamW last)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if train.optimizer == "adamw":
        return [torch.optim.AdamW(params, lr=train.lr, weight_decay=train.weight_decay)]
    muon, adamw = muon_split(model)
    logger.info("Muon over %d weight matrices (%d values), AdamW over %d other tensors",
                len(muon), sum(p.numel() for p in muon), len(adamw))
    parts: list[torch.optim.Optimizer] = []
    if muon:
        parts.append(torch.optim.Muon(
            muon, lr=train.lr if train.muon_lr is None else train.muon_lr,
            momentum=train.muon_momentum, weight_decay=train.muon_weight_decay,
            ns_steps=train.muon_ns_steps, adjust_lr_fn=train.muon_adjust_lr))
    if adamw:
        parts.append(torch.optim.AdamW(adamw, lr=train.lr, weight_decay=train.weight_decay))
    return parts


def warmup_cosine(train: TrainConfig):
    """The schedule's factor at a step: linear warm-up, then cosine down to 10 %."""
    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        progress = (step - train.warmup_steps) / max(1, train.steps - train.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    return factor


class DraftOptimizer:
    """The optimizers of `train.optimizer` stepped together, each with the warm-up + cosine
    schedule, checkpointed together (`state_dict`)."""

    def __init__(self, model: torch.nn.Module, train: TrainConfig) -> None:
        self.parts = build_optimizers(model, train)
        self.schedules = [torch.optim.lr_scheduler.LambdaLR(part, warmup_cosine(train))
                          for part in self.parts]

    @property
    def scheduled_steps(self) -> int:
        """Steps the schedule has advanced (stepped or skipped)."""
        return self.schedules[0].last_epoch

    @property
    def lr(self) -> float:
        """AdamW's current learning rate (`train.lr` through the schedule)."""
        return self.schedules[-1].get_last_lr()[0]

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=True)

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def advance_schedule(self) -> None:
        with warnings.catch_warnings():  # a first step skipped: the schedule advances alone
            warnings.filterwarnings("ignore", message=".*lr_scheduler.step.*optimizer.step")
            for schedule in self.schedules:
                schedule.step()

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [part.state_dict() for part in self.parts],
                "schedules": [schedule.state_dict() for schedule in self.schedules]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["optimizers"]) != len(self.parts):
            raise ValueError(f"the checkpoint holds {len(state['optimizers'])} optimizers, "
                             f"this learner has {len(self.parts)} (another train.optimizer)")
        for part, saved in zip(self.parts, state["optimizers"], strict=True):
            part.load_state_dict(saved)
        for schedule, saved in zip(self.schedules, state["schedules"], strict=True):
            schedule.load_state_dict(saved)
