"""The shift: slot `t` pairs the aux states at `t` with token `t + 1` and the target at `t + 1`.

Every backend's unshifted output goes through `shift_supervision`, so all engines agree on every
slot, padding included (docs/contract.md, "Shift").
"""

from __future__ import annotations

from collections.abc import Callable

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
    return {
        "aux_hidden_states": aux_hidden_states.masked_fill_(valid.logical_not().unsqueeze(-1), 0),
        **_shift_tokens(input_ids, attention_mask, loss_mask),
        "last_hidden": shift_left_by_one(last_hidden).masked_fill_(
            has_next.logical_not().unsqueeze(-1), 0),
    }


def shift_captured_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    rows: list[torch.Tensor],
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """`shift_supervision` for states captured row by row in host memory: row `i` is
    `[n_i, L + 1, H]`, its `L` aux layers then the final pre-norm state at each of its `n_i`
    tokens (vLLM's capture layout). Each value is copied once, straight into its shifted slot of
    the batch, and only padding is zeroed: no padded copy first, no temporaries (an 8B engine
    call of 16,384 tokens captures 512 MiB; this is the host's whole share of it). `empty(shape,
    dtype)` allocates the two outputs (default `torch.empty`; a replica reuses its buffers)."""
    batch, seq = input_ids.shape
    _, slots, hidden = rows[0].shape
    num_aux = slots - 1
    empty = empty or (lambda shape, dtype: torch.empty(shape, dtype=dtype))
    aux = empty((batch, seq, num_aux * hidden), rows[0].dtype)
    last = empty((batch, seq, hidden), rows[0].dtype)
    for row, states in enumerate(rows):
        n = states.shape[0]
        aux[row, :n].view(n, num_aux, hidden).copy_(states[:, :num_aux])
        aux[row, n:].zero_()
        last[row, :n - 1].copy_(states[1:, num_aux])  # slot t holds the state at t + 1
        last[row, n - 1:].zero_()
    return {"aux_hidden_states": aux, **_shift_tokens(input_ids, attention_mask, loss_mask),
            "last_hidden": last}


def _shift_tokens(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  loss_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The shifted ids and loss mask, and the unshifted attention mask."""
    no_next = next_position_mask(attention_mask).logical_not()
    return {
        "input_ids": shift_left_by_one(input_ids.long()).masked_fill_(no_next, 0),
        "attention_mask": attention_mask.long(),
        "loss_mask": shift_left_by_one(loss_mask.long()).masked_fill_(no_next, 0),
    }
