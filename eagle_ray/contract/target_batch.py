"""The supervision record every backend returns, and the input checks every backend applies.

This module is the contract's data layer: it imports nothing of eagle_ray (only torch and
numpy), so every other module can import it and no import cycle can pass through it. The
contract itself -- layer ids, shift, encodings -- is written down in `docs/contract.md`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np
import torch

NUM_AUX_LAYERS = 3  # EAGLE-3 reads three target layers: low, middle, high (the default)
Encoding = Literal["logits", "last_hidden", "target_probs"]
ENCODINGS: tuple[str, ...] = ("logits", "last_hidden", "target_probs")


@dataclasses.dataclass
class Eagle3TargetBatch:
    """Supervision for one micro-batch, already shifted (docs/contract.md, "Shift").

    Shapes: `aux_hidden_states [B, S, N*H]` (the `num_aux_layers` = N captured layers,
    ascending); `input_ids`, `attention_mask`, `loss_mask [B, S]`; exactly one target encoding:
    `logits [B, S, V]`, `last_hidden [B, S, H]` (pre-norm; apply the `TargetHead`), or
    `target_probs [B, S, V_draft]` with `position_mask [B, S]`. Slots without a next position
    (padding, each row's last token) hold zeros. `positions [B, S]` (unshifted, 0 on padding):
    the position the draft's slot `t` sits at where it is not `t` -- a vision-language target's
    temporal M-RoPE index, as vLLM's proposer feeds a draft without M-RoPE (docs/contract.md,
    "Images"); None: `0 .. S-1`.
    """

    aux_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    position_mask: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    num_aux_layers: int = dataclasses.field(default=NUM_AUX_LAYERS, kw_only=True)

    def __post_init__(self) -> None:
        self._validate()

    @property
    def encoding(self) -> str:
        for name in ENCODINGS:
            if getattr(self, name) is not None:
                return name
        raise AssertionError("unreachable: validated on construction")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensor fields that are set, by name (what a transport moves; `num_aux_layers`
        travels beside them)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def with_tensors(self, **tensors: torch.Tensor) -> Eagle3TargetBatch:
        """A batch of the same aux layer count holding `tensors` (validated again)."""
        return Eagle3TargetBatch(**tensors, num_aux_layers=self.num_aux_layers)

    @property
    def hidden_size(self) -> int:
        """H: the width of one captured layer."""
        return self.aux_hidden_states.shape[-1] // self.num_aux_layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> Eagle3TargetBatch:
        return self.with_tensors(**{k: v.to(device) for k, v in self.tensors().items()})

    def _validate(self) -> None:
        aux = self.aux_hidden_states
        layers = self.num_aux_layers
        _require(isinstance(layers, int) and layers >= 1, "num_aux_layers",
                 f"a positive int, got {layers!r}")
        _require(aux.dim() == 3 and aux.is_floating_point(), "aux_hidden_states",
                 f"a float tensor [B, S, {layers}H], got {_describe(aux)}")
        batch, seq, width = aux.shape
        _require(width % layers == 0 and width > 0, "aux_hidden_states",
                 f"a last dimension of {layers} (num_aux_layers) x the hidden size, got {width}")
        hidden = width // layers
        for name in ("input_ids", "attention_mask", "loss_mask", "positions"):
            t = getattr(self, name)
            if t is None and name == "positions":
                continue
            _require(t.shape == (batch, seq) and not t.is_floating_point(), name,
                     f"an integer or bool tensor [{batch}, {seq}], got {_describe(t)}")
        encodings = [n for n in ENCODINGS if getattr(self, n) is not None]
        if len(encodings) != 1:
            raise ValueError(
                f"an Eagle3TargetBatch carries exactly one target encoding out of {ENCODINGS}, "
                f"got {encodings or 'none'}"
            )
        encoding = encodings[0]
        value = getattr(self, encoding)
        _require(value.dim() == 3 and value.shape[:2] == (batch, seq)
                 and value.is_floating_point(), encoding,
                 f"a float tensor [{batch}, {seq}, ...], got {_describe(value)}")
        if encoding == "last_hidden":
            _require(value.shape[2] == hidden, "last_hidden",
                     f"hidden size {hidden} (aux_hidden_states' width / {layers} aux layers), "
                     f"got {value.shape[2]}")
        if encoding == "target_probs":
            pm = self.position_mask
            _require(pm is not None and pm.shape == (batch, seq) and pm.dtype == torch.bool,
                     "position_mask", f"a bool tensor [{batch}, {seq}] alongside target_probs, "
                     f"got {_describe(pm)}")
        elif self.position_mask is not None:
            raise ValueError("position_mask goes only with the target_probs encoding")


def _require(ok: bool, name: str, expected: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}")


def _describe(t: torch.Tensor | None) -> str:
    return "None" if t is None else f"{t.dtype} of shape {list(t.shape)}"


def validate_micro_batch(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    vocab_size: int,
    max_length: int | None = None,
) -> None:
    """Reject a micro-batch that no backend could serve, saying what is wrong and what to do.

    Called before anything reaches an engine (and by the pool client before anything travels).
    """
    for name, t in (("input_ids", input_ids), ("attention_mask", attention_mask),
                    ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(
            f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; "
            f"convert with input_ids.long()"
        )
    if input_ids.dim() != 2:
        raise ValueError(
            f"input_ids must be 2-D [batch, seq], got shape {list(input_ids.shape)}; "
            f"for a single row use input_ids.unsqueeze(0)"
        )
    if input_ids.numel() == 0:
        raise ValueError(f"empty micro-batch: input_ids has shape {list(input_ids.shape)}")
    for name, mask in (("attention_mask", attention_mask), ("loss_mask", loss_mask)):
        if mask.shape != input_ids.shape:
            raise ValueError(
                f"{name} shape {list(mask.shape)} does not match input_ids shape "
                f"{list(input_ids.shape)}"
            )
        if mask.is_floating_point() or mask.is_complex():
            raise TypeError(f"{name} must be an integer or bool tensor, got {mask.dtype}")
    # The value checks run on numpy views: a few microseconds per check where torch's dispatch
    # costs tens, and they run for every micro-batch on the client and on the replica.
    ids, attention, loss = (t.detach().cpu().numpy() for t in (input_ids, attention_mask,
                                                               loss_mask))
    for name, mask in (("attention_mask", attention), ("loss_mask", loss)):
        if mask.dtype != np.bool_ and (mask.min() < 0 or mask.max() > 1):
            raise ValueError(f"{name} must hold only 0 and 1")
    attended = attention.astype(bool, copy=False)
    lengths = attended.sum(axis=1)
    if not lengths.all():
        rows = np.flatnonzero(lengths == 0).tolist()
        raise ValueError(f"rows {rows} have no tokens (attention_mask all zero); drop them")
    right_padded = np.arange(ids.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(right_padded, attended):
        raise ValueError(
            "attention_mask must be right-padded (each row: ones, then zeros); left padding or "
            "holes are not supported -- re-pad the rows on the right"
        )
    if np.any(loss.astype(bool, copy=False) & ~attended):
        raise ValueError("loss_mask is set on padding slots (where attention_mask is 0)")
    real = ids[attended]
    if real.min() < 0 or real.max() >= vocab_size:
        bad = real[(real < 0) | (real >= vocab_size)]
        raise ValueError(
            f"token ids must be in [0, {vocab_size}) (the target's vocabulary), found "
            f"{sorted(set(bad.tolist()))[:8]}; was the data tokenized with the target's tokenizer?"
        )
    if max_length is not None and int(lengths.max()) > max_length:
        raise ValueError(
            f"a row has {int(lengths.max())} tokens but the target accepts at most {max_length}; "
            f"truncate or filter longer rows"
        )


def validate_prompts(prompts: list[list[int]], *, vocab_size: int, max_length: int | None,
                     max_new_tokens: int) -> None:
    """Reject prompts for text generation that no backend could serve."""
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError(f"prompts must be a non-empty list of token-id lists, got {prompts!r:.80}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if not isinstance(prompt, list | tuple) or not prompt or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise TypeError(f"prompt {i} must be a non-empty list of int token ids, got "
                            f"{str(prompt)[:80]}")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab_size}): {bad[:8]}")
        if max_length is not None and len(prompt) + max_new_tokens > max_length + 1:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens="
                             f"{max_new_tokens} that exceeds the {max_length + 1} tokens the "
                             f"target holds; shorten the prompt or lower max_new_tokens")
