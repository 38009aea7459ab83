"""Optimizer steps refused for a non-finite loss or gradient.

One NaN gradient written into the draft by AdamW makes every weight NaN, and the job would train
on for hours. A step whose loss or gradient norm is NaN or inf (supervision holding them, from a
cache or an engine without the pool's check; an overflow in the draft) is skipped instead: no
weight and no optimizer state is written from it and its gradient is dropped. Under DDP every
rank skips the same steps: a rank's loss is its own, so the flag is all-reduced (max) before
anyone decides; ranks that decided apart would hold different weights from then on.
`train.max_nonfinite_steps` skipped in a row stop the job: the draft no longer learns.

Cost: the flag is read on the host each step (as torch's GradScaler reads its own), so the host
waits for the backward pass before it queues the optimizer's kernels; under DDP one all-reduce
of one value per step.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


class NonFiniteTraining(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient: the job stops."""


class NonFiniteGuard:
    """Decides, for each step, whether its loss and gradient norm are finite on every rank;
    counts what it refused (`skipped`: in all; `in_a_row`) and raises `NonFiniteTraining` once
    `max_in_a_row` steps in a row were refused."""

    def __init__(self, max_in_a_row: int) -> None:
        if max_in_a_row < 1:
            raise ValueError(f"train.max_nonfinite_steps must be >= 1, got {max_in_a_row}")
        self.max_in_a_row = max_in_a_row
        self.skipped = 0
        self.in_a_row = 0

    def take(self, loss: torch.Tensor, grad_norm: torch.Tensor, step: int) -> bool:
        """Whether step `step` may write the weights: its `loss` and `grad_norm` finite on this
        rank and every other. A refused step is counted and logged."""
        loss = loss.detach()
        bad = (torch.isfinite(loss) & torch.isfinite(grad_norm)).logical_not()
        bad = bad.to(torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)  # any rank's refusal is every rank's
        if not bool(bad):
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        logger.warning("step %d skipped on rank %d: loss %s, gradient norm %s here (a non-finite "
                       "value on this rank or another); %d in a row, %d in all", step, rank,
                       float(loss), float(grad_norm), self.in_a_row, self.skipped)
        if self.in_a_row >= self.max_in_a_row:
            raise NonFiniteTraining(
                f"{self.in_a_row} optimizer steps in a row (up to step {step}) had a non-finite "
                f"loss or gradient on some rank (rank {rank}: loss {float(loss)}, gradient norm "
                f"{float(grad_norm)}; train.max_nonfinite_steps = {self.max_in_a_row}); the "
                f"draft keeps the weights of its last finite step. Check the supervision (the "
                f"pool refuses NaN or inf from its engines; a supervision cache written by an "
                f"older version may hold them), lower train.lr or train in fp32 "
                f"(train.precision)")
        return False
