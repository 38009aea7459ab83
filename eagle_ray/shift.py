"""The shift: slot `t` pairs the aux states at `t` with token `t + 1` and the target at `t + 1`.

Every backend's unshifted output goes through `shift_supervision`, so all engines agree on every
slot, padding included (docs/contract.md, "Shift").
"""

from __future__ import annotations

import torch


def next_position_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, S]` bool: slot `t` has a position `t + 1` in its row (so it carries a target)."""
    return shift_left_by_one(attention_mask.bool())


def shift_left_by_one(x: torch.Tensor) -> torch.Tensor:
    """`x[:, t + 1]` at slot t, zero in the last slot. (`narrow`, not indexing: Python indexing
    cannot run on the device tests' fake GPU tensors.)"""
    seq = x.shape[1]
    return torch.cat([x.narrow(1, 1, seq - 1), torch.zeros_like(x.narrow(1, 0, 1))], dim=1)


def shift_supervision(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    last_hidden: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Shift unshifted runner output into supervision (docs/contract.md, "Shift").

    Slot `t` pairs the aux states at position `t` with token `x[t+1]` and the target's state at
    `t+1`; slots without a position `t+1` in their row are zeroed, so every backend agrees on
    every slot (not only unpadded ones). `aux_hidden_states` (the largest tensor, owned by the
    caller's runner output) is zeroed at padding in place rather than copied.
    """
    valid = attention_mask.bool()
    has_next = next_position_mask(attention_mask)

    def shift_left(x: torch.Tensor) -> torch.Tensor:
        mask = has_next if x.dim() == 2 else has_next.unsqueeze(-1)
        return shift_left_by_one(x).masked_fill_(mask.logical_not(), 0)

    return {
        "aux_hidden_states": aux_hidden_states.masked_fill_(valid.logical_not().unsqueeze(-1), 0),
        "input_ids": shift_left(input_ids.long()),
        "attention_mask": attention_mask.long(),
        "loss_mask": shift_left(loss_mask.long()),
        "last_hidden": shift_left(last_hidden),
    }
