"""The EAGLE-3 target contract: supervision batch, aux-layer rules, shift, and the base backend.

Every target backend (transformers, vLLM, a remote pool) returns the same `Eagle3TargetBatch` for
the same micro-batch. What differs between engines is only how the *unshifted* hidden states are
produced; that part is a `TargetRunner`. Everything that must agree across engines -- which layers,
how rows are shifted, how the target distribution is encoded -- lives here, once.

This module imports neither Ray nor vLLM.

Example:
    >>> from eagle_ray.hf_target import HFEagle3TargetModel
    >>> target = HFEagle3TargetModel.from_pretrained("path/to/target")    # doctest: +SKIP
    >>> batch = target.generate_batch(input_ids, attention_mask, loss_mask)  # doctest: +SKIP
    >>> batch.aux_hidden_states.shape  # [B, S, 3 * H]                        # doctest: +SKIP
"""

from __future__ import annotations

import abc
import dataclasses
import logging
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from eagle_ray.supervision import DraftVocab, draft_target_from_hidden
from eagle_ray.target_head import TargetHead

logger = logging.getLogger(__name__)

NUM_AUX_LAYERS = 3
Encoding = Literal["logits", "last_hidden", "target_probs"]
ENCODINGS: tuple[str, ...] = ("logits", "last_hidden", "target_probs")


# --------------------------------------------------------------------------- aux layer ids


def default_eagle3_aux_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low / middle / high layers in the post-layer convention: `[1, N//2 - 1, N - 4]`.

    Id `k` is the residual stream *after* decoder layer `k` (HF `output_hidden_states[k + 1]`).
    """
    ids = [1, num_layers // 2 - 1, num_layers - 4]
    if not (0 <= ids[0] < ids[1] < ids[2] < num_layers):
        raise ValueError(
            f"a target with {num_layers} decoder layers is too shallow for the default EAGLE-3 aux "
            f"layers [1, N//2-1, N-4] = {ids}; pass aux_layer_ids explicitly: three distinct, "
            f"ascending layer ids in [0, {num_layers})"
        )
    return ids


def validate_eagle3_aux_layer_ids(ids: Sequence[int], num_layers: int) -> list[int]:
    """Check canonical (post-layer) aux ids: three distinct ints in `[0, N)`, ascending."""
    ids = list(ids)
    if len(ids) != NUM_AUX_LAYERS:
        raise ValueError(
            f"EAGLE-3 needs exactly {NUM_AUX_LAYERS} aux layer ids, got {len(ids)}: {ids}; "
            f"pass three (the default for this target is "
            f"{_default_or_none(num_layers)})"
        )
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise TypeError(f"aux layer ids must be ints, got {ids!r}")
    if len(set(ids)) != len(ids):
        raise ValueError(f"aux layer ids must be distinct, got {ids}")
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"aux layer ids {bad} are outside [0, {num_layers}) for a target with {num_layers} "
            f"decoder layers (id k = output of decoder layer k, 0-based; the embedding is not a "
            f"layer)"
        )
    if ids != sorted(ids):
        raise ValueError(
            f"aux layer ids must be ascending (the aux states are concatenated in layer order), "
            f"got {ids}; pass {sorted(ids)}"
        )
    return ids


def resolve_eagle3_aux_layer_ids(ids: Sequence[int] | None, num_layers: int) -> list[int]:
    """The given ids validated, or the default ones when `ids` is None (what every backend does
    before it builds its engine)."""
    if ids is None:
        return default_eagle3_aux_layer_ids(num_layers)
    return validate_eagle3_aux_layer_ids(ids, num_layers)


def _default_or_none(num_layers: int) -> list[int] | None:
    try:
        return default_eagle3_aux_layer_ids(num_layers)
    except ValueError:
        return None


def vllm_capture_layer_ids(aux_layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Translate canonical ids to vLLM's pre-layer `extract_hidden_states` ids.

    vLLM's id `j` is the stream *entering* layer `j`, so canonical `k` is `k + 1`; the extra id `N`
    is the final hidden state before the final norm (our `last_hidden`). Canonical `N - 1` would be
    captured twice under one id, which vLLM deduplicates, so it is refused.
    """
    ids = validate_eagle3_aux_layer_ids(aux_layer_ids, num_layers)
    if num_layers - 1 in ids:
        raise ValueError(
            f"aux layer id {num_layers - 1} (the last decoder layer) collides with the final "
            f"hidden state that the vLLM backend captures as id {num_layers}; choose ids below "
            f"{num_layers - 1}"
        )
    return [i + 1 for i in ids] + [num_layers]


# --------------------------------------------------------------------------- the batch


@dataclasses.dataclass
class Eagle3TargetBatch:
    """Supervision for one micro-batch, already shifted (DESIGN §2.2).

    Shapes: `aux_hidden_states [B, S, 3H]`; `input_ids`, `attention_mask`, `loss_mask [B, S]`;
    exactly one target encoding: `logits [B, S, V]`, `last_hidden [B, S, H]` (pre-norm; apply
    the `TargetHead`), or `target_probs [B, S, V_draft]` with `position_mask [B, S]`.
    Slots without a next position (padding, each row's last token) hold zeros.
    """

    aux_hidden_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logits: torch.Tensor | None = None
    last_hidden: torch.Tensor | None = None
    target_probs: torch.Tensor | None = None
    position_mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        self._validate()

    @property
    def encoding(self) -> str:
        for name in ENCODINGS:
            if getattr(self, name) is not None:
                return name
        raise AssertionError("unreachable: validated on construction")

    def tensors(self) -> dict[str, torch.Tensor]:
        """The fields that are set, by name (what a transport moves)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def to(self, device: torch.device | str) -> Eagle3TargetBatch:
        return Eagle3TargetBatch(**{k: v.to(device) for k, v in self.tensors().items()})

    def _validate(self) -> None:
        aux = self.aux_hidden_states
        _require(aux.dim() == 3 and aux.is_floating_point(), "aux_hidden_states",
                 f"a float tensor [B, S, 3H], got {_describe(aux)}")
        batch, seq, width = aux.shape
        _require(width % NUM_AUX_LAYERS == 0, "aux_hidden_states",
                 f"a last dimension divisible by {NUM_AUX_LAYERS}, got {width}")
        hidden = width // NUM_AUX_LAYERS
        for name in ("input_ids", "attention_mask", "loss_mask"):
            t = getattr(self, name)
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
                     f"hidden size {hidden} (a third of aux_hidden_states), got {value.shape[2]}")
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


# --------------------------------------------------------------------------- input checks


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
        if not torch.all((mask == 0) | (mask == 1)):
            raise ValueError(f"{name} must hold only 0 and 1")
    attended = attention_mask.bool()
    lengths = attended.sum(dim=1)
    if torch.any(lengths == 0):
        rows = torch.nonzero(lengths == 0).flatten().tolist()
        raise ValueError(f"rows {rows} have no tokens (attention_mask all zero); drop them")
    right_padded = torch.arange(input_ids.shape[1]).unsqueeze(0) < lengths.unsqueeze(1)
    if not torch.equal(right_padded, attended):
        raise ValueError(
            "attention_mask must be right-padded (each row: ones, then zeros); left padding or "
            "holes are not supported -- re-pad the rows on the right"
        )
    if torch.any(loss_mask.bool() & ~attended):
        raise ValueError("loss_mask is set on padding slots (where attention_mask is 0)")
    ids = input_ids[attended]
    if torch.any(ids < 0) or torch.any(ids >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        raise ValueError(
            f"token ids must be in [0, {vocab_size}) (the target's vocabulary), found "
            f"{sorted(set(bad.tolist()))[:8]}; was the data tokenized with the target's tokenizer?"
        )
    if max_length is not None and int(lengths.max()) > max_length:
        raise ValueError(
            f"a row has {int(lengths.max())} tokens but the target accepts at most {max_length}; "
            f"truncate or filter longer rows"
        )


# --------------------------------------------------------------------------- shift


def next_position_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """`[B, S]` bool: slot `t` has a position `t + 1` in its row (so it carries a target)."""
    valid = attention_mask.bool()
    has_next = torch.zeros_like(valid)
    has_next[:, :-1] = valid[:, 1:]
    return has_next


def shift_supervision(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    aux_hidden_states: torch.Tensor,
    last_hidden: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Apply DESIGN §2.2 to unshifted runner output.

    Slot `t` pairs the aux states at position `t` with token `x[t+1]` and the target's state at
    `t+1`; slots without a position `t+1` in their row are zeroed, so every backend agrees on
    every slot (not only unpadded ones). `aux_hidden_states` (the largest tensor, owned by the
    caller's runner output) is zeroed at padding in place rather than copied.
    """
    valid = attention_mask.bool()
    has_next = next_position_mask(attention_mask)

    def shift_left(x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        out[:, :-1] = x[:, 1:]
        mask = has_next if x.dim() == 2 else has_next.unsqueeze(-1)
        return out.masked_fill_(~mask, 0)

    return {
        "aux_hidden_states": aux_hidden_states.masked_fill_(~valid.unsqueeze(-1), 0),
        "input_ids": shift_left(input_ids.long()),
        "attention_mask": attention_mask.long(),
        "loss_mask": shift_left(loss_mask.long()),
        "last_hidden": shift_left(last_hidden),
    }


# --------------------------------------------------------------------------- the base backend


@dataclasses.dataclass
class RunnerOutput:
    """Unshifted hidden states for a right-padded batch; values at pad positions are ignored."""

    aux_hidden_states: torch.Tensor  # [B, S, 3H], ascending layer order
    last_hidden: torch.Tensor  # [B, S, H], final hidden state before the final norm
    # [B] the engine's own greedy next token after each row, when it samples one (vLLM does);
    # the base checks it against the head applied to last_hidden (the self-check).
    next_token_ids: torch.Tensor | None = None


class TargetRunner(abc.ABC):
    """The engine seam: turns token ids into unshifted aux states and the pre-norm last hidden.

    Called by `RunnerEagle3TargetModel.generate_batch` with a validated, right-padded batch; the
    runner never shifts, encodes or validates ids. It captures exactly the canonical aux layer ids
    it was built with.
    """

    @abc.abstractmethod
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        """Run one micro-batch through the target engine."""


class RunnerEagle3TargetModel:
    """Engine-agnostic EAGLE-3 target backend built on a `TargetRunner`.

    Owns what must be identical on every engine: aux-layer defaulting and validation, input
    checks, the shift, the target encodings, and access to the target's embedding and head.
    """

    def __init__(
        self,
        runner: TargetRunner,
        *,
        num_hidden_layers: int,
        vocab_size: int,
        aux_layer_ids: Sequence[int],
        embedding: nn.Embedding,
        head: TargetHead,
        encoding: Encoding = "last_hidden",
        draft_vocab: DraftVocab | None = None,
        max_length: int | None = None,
        self_check: bool = True,
    ) -> None:
        self.runner = runner
        self.self_check = self_check
        self.num_hidden_layers = num_hidden_layers
        self.vocab_size = vocab_size
        self._aux_layer_ids = validate_eagle3_aux_layer_ids(aux_layer_ids, num_hidden_layers)
        self._embedding = embedding
        self._head = head
        self.max_length = max_length
        self.draft_vocab = draft_vocab
        self.encoding = _check_encoding(encoding, draft_vocab)

    @property
    def aux_layer_ids(self) -> list[int]:
        """Canonical (post-layer) ids of the three captured layers, ascending."""
        return list(self._aux_layer_ids)

    def get_input_embeddings(self) -> nn.Embedding:
        """The target's input embedding (the draft copies it and keeps it frozen)."""
        return self._embedding

    def get_target_head(self) -> TargetHead:
        """The target's own final norm + `lm_head`, to decode the `last_hidden` encoding."""
        return self._head

    # no_grad, not inference_mode: a co-located trainer may feed the results to autograd.
    @torch.no_grad()
    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        *,
        encoding: Encoding | None = None,
    ) -> Eagle3TargetBatch:
        """Supervision for one right-padded micro-batch, shifted per DESIGN §2.2."""
        encoding = _check_encoding(encoding or self.encoding, self.draft_vocab)
        if loss_mask is None:
            loss_mask = attention_mask
        validate_micro_batch(input_ids, attention_mask, loss_mask,
                             vocab_size=self.vocab_size, max_length=self.max_length)
        out = self.runner.run(input_ids, attention_mask)
        batch, seq = input_ids.shape
        if out.aux_hidden_states.shape[:2] != (batch, seq) or out.last_hidden.shape[:2] != (
            batch, seq
        ):
            raise RuntimeError(
                f"runner {type(self.runner).__name__} returned aux "
                f"{list(out.aux_hidden_states.shape)} and last_hidden "
                f"{list(out.last_hidden.shape)} for a [{batch}, {seq}] batch"
            )
        if self.self_check and out.next_token_ids is not None:
            check_greedy_tokens(out.next_token_ids, out.last_hidden, attention_mask, self._head)
        fields = shift_supervision(input_ids, attention_mask, loss_mask,
                                   out.aux_hidden_states, out.last_hidden)
        last_hidden = fields.pop("last_hidden")
        if encoding == "last_hidden":
            return Eagle3TargetBatch(**fields, last_hidden=last_hidden)
        has_next = next_position_mask(attention_mask)
        if encoding == "logits":
            logits = self._head(last_hidden).masked_fill_(~has_next.unsqueeze(-1), 0)
            return Eagle3TargetBatch(**fields, logits=logits)
        probs, position_mask = draft_target_from_hidden(last_hidden, self._head, self.draft_vocab)
        return Eagle3TargetBatch(
            **fields,
            target_probs=probs.masked_fill_(~has_next.unsqueeze(-1), 0),
            position_mask=position_mask & has_next,
        )


class SelfCheckError(RuntimeError):
    """The engine's greedy token disagrees with the head applied to the captured final state."""


def check_greedy_tokens(next_token_ids: torch.Tensor, last_hidden: torch.Tensor,
                        attention_mask: torch.Tensor, head: TargetHead) -> None:
    """Each row's engine-sampled greedy token must be the argmax of `head(last_hidden[last])`.

    This catches the silent failures of capture: a layer-id convention off by one, a final norm
    applied twice or not at all, a head in the wrong dtype. Near-ties (within the precision of
    the head's dtype) are accepted.
    """
    last_position = attention_mask.sum(dim=1) - 1
    rows = torch.arange(last_hidden.shape[0])
    logits = head(last_hidden[rows, last_position]).float()  # [B, V]
    best = logits.max(dim=-1).values
    chosen = logits[rows, next_token_ids.to(logits.device)]
    eps = torch.finfo(head.lm_head.weight.dtype).eps
    tolerance = max(1e-4, 64 * eps) * best.abs().clamp_min(1.0)
    bad = torch.nonzero(chosen < best - tolerance).flatten().tolist()
    if bad:
        row = bad[0]
        raise SelfCheckError(
            f"self-check failed on {len(bad)} of {len(rows)} rows: the engine's greedy token "
            f"{int(next_token_ids[row])} (logit {float(chosen[row]):.4f}) is not the argmax "
            f"{int(logits[row].argmax())} (logit {float(best[row]):.4f}) of the target head "
            f"applied to the captured final hidden state (row {row}). Likely causes: capture "
            "ids in the wrong layer-id convention (vLLM's are pre-layer: canonical k -> k + 1, "
            "final state -> N), the final norm applied twice or not at all, or a dtype "
            "mismatch between the engine and the head. Pass self_check=False only to debug."
        )


def _check_encoding(encoding: str, draft_vocab: DraftVocab | None) -> Encoding:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown target encoding {encoding!r}; choose one of {ENCODINGS}")
    if encoding == "target_probs" and draft_vocab is None:
        raise ValueError("the target_probs encoding needs a draft_vocab (a DraftVocab)")
    return encoding  # type: ignore[return-value]
