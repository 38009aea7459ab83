"""The engine seam and the engine-agnostic EAGLE-3 target backend built on it.

Every target backend (transformers, vLLM, a remote pool) returns the same `Eagle3TargetBatch` for
the same micro-batch. What differs between engines is only how the *unshifted* hidden states are
produced; that part is a `TargetRunner`. `RunnerEagle3TargetModel` owns everything that must agree
across engines -- input checks, the shift, the encodings, the self-check -- by calling the modules
that hold each rule once: `target_batch` (the record and input checks), `aux_layers` (layer ids),
`shift`, `supervision` (draft vocabulary). The contract is written down in `docs/contract.md`.

This module imports neither Ray nor vLLM. It re-exports the contract's public names, so
`from eagle_ray.target_runner import Eagle3TargetBatch` (its public path) and friends keep working.

Example:
    >>> from eagle_ray.backends.hf import HFEagle3TargetModel
    >>> target = HFEagle3TargetModel.from_pretrained("path/to/target")    # doctest: +SKIP
    >>> batch = target.generate_batch(input_ids, attention_mask, loss_mask)  # doctest: +SKIP
    >>> batch.aux_hidden_states.shape  # [B, S, 3 * H]                        # doctest: +SKIP
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn

from eagle_ray.backends.self_check import (
    SelfCheckError,
    check_greedy_tokens,
    check_ranks_agree,
    greedy_shortfall,
    refused_rows,
)
from eagle_ray.contract.aux_layers import (
    default_eagle3_aux_layer_ids,
    resolve_eagle3_aux_layer_ids,
    validate_aux_layer_ids,
    validate_eagle3_aux_layer_ids,
    vllm_capture_layer_ids,
)
from eagle_ray.contract.images import ImageInputs, ImageTokens, validate_images
from eagle_ray.contract.shift import next_position_mask, shift_captured_rows, shift_supervision
from eagle_ray.contract.supervision import DraftVocab, draft_target_from_hidden, head_logits
from eagle_ray.contract.target_batch import (
    ENCODINGS,
    NUM_AUX_LAYERS,
    Eagle3TargetBatch,
    Encoding,
    validate_micro_batch,
    validate_prompts,
)
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.devices import EmptyHost, HostBuffers, hand_over, to_device

__all__ = [
    "ENCODINGS", "NUM_AUX_LAYERS", "Eagle3TargetBatch", "EngineOutput", "Encoding",
    "RunnerEagle3TargetModel",
    "RunnerOutput", "Sampling", "SelfCheckError", "TargetRunner", "check_greedy_tokens",
    "check_ranks_agree",
    "greedy_shortfall", "refused_rows",
    "default_eagle3_aux_layer_ids", "next_position_mask", "resolve_eagle3_aux_layer_ids",
    "shift_supervision", "validate_aux_layer_ids", "validate_eagle3_aux_layer_ids",
    "validate_micro_batch",
    "validate_prompts",
    "vllm_capture_layer_ids",
]


@dataclasses.dataclass
class RunnerOutput:
    """Unshifted hidden states of a right-padded batch, in one of two layouts: padded tensors
    (`aux_hidden_states`, `last_hidden`; values at pad positions are ignored), or `rows` as an
    engine captured them, unpadded (vLLM: each request's states arrive on their own)."""

    aux_hidden_states: torch.Tensor | None = None  # [B, S, N*H], ascending layer order
    last_hidden: torch.Tensor | None = None  # [B, S, H], final hidden state before the final norm
    # [B] the engine's own greedy next token after each row, when it samples one (vLLM does);
    # the base checks it against the head applied to the final state (the self-check).
    next_token_ids: torch.Tensor | None = None
    # per row [n_i, N + 1, H]: the N aux layers (ascending), then the final pre-norm state
    rows: list[torch.Tensor] | None = None
    # [B, S] where a draft's slot t does not sit at position t: a vision-language target's
    # temporal M-RoPE index (docs/contract.md, "Images"); None: 0 .. S-1
    positions: torch.Tensor | None = None

    def __post_init__(self) -> None:
        padded = self.aux_hidden_states is not None and self.last_hidden is not None
        if padded == (self.rows is not None):
            raise ValueError("a RunnerOutput holds either aux_hidden_states and last_hidden "
                             "(padded) or rows (as captured), not both or neither")

    @property
    def device(self) -> torch.device:
        """Where the states are (the shift runs there)."""
        return (self.rows[0] if self.rows is not None else self.aux_hidden_states).device

    def check_shape(self, batch: int, seq: int) -> None:
        """States for every row of a `[batch, seq]` micro-batch, or a RuntimeError naming what
        came back instead."""
        if self.rows is not None:
            got = [list(r.shape) for r in self.rows]
            if len(got) == batch and all(
                    r.dim() == 3 and r.shape[1] == self.rows[0].shape[1] >= 2
                    and r.shape[0] <= seq for r in self.rows):
                return
        else:
            got = [list(self.aux_hidden_states.shape), list(self.last_hidden.shape)]
            if (self.aux_hidden_states.shape[:2] == (batch, seq)
                    and self.last_hidden.shape[:2] == (batch, seq)):
                return
        raise RuntimeError(f"the runner returned states of shapes {got} for a [{batch}, {seq}] "
                           f"micro-batch")

    def final_states(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """`[B, H]`: each row's final pre-norm state at its last position (what the
        self-check decodes)."""
        if self.rows is not None:
            return torch.stack([r[-1, -1] for r in self.rows])
        last_position = (attention_mask.sum(dim=1) - 1).view(-1, 1, 1)
        hidden = self.last_hidden.shape[-1]
        return self.last_hidden.gather(1, last_position.expand(-1, 1, hidden)).squeeze(1)

    def shifted(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                loss_mask: torch.Tensor, empty: EmptyHost) -> dict[str, torch.Tensor]:
        """The shifted supervision fields, `last_hidden` included (`eagle_ray.contract.shift`); rows
        are shifted into tensors from `empty` (a `HostBuffers` use)."""
        if self.rows is not None:
            return shift_captured_rows(input_ids, attention_mask, loss_mask, self.rows, empty)
        (last_hidden,) = hand_over([self.last_hidden], self.device)
        return shift_supervision(input_ids, attention_mask, loss_mask, self.aux_hidden_states,
                                 last_hidden)


@dataclasses.dataclass
class EngineOutput:
    """What `run_engine` hands `finish_batch`: the checked inputs and the runner's output."""

    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S]
    runner_output: RunnerOutput


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How to generate text with the target (answer regeneration). Temperature 0 is greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = 0
    stop_token_ids: tuple[int, ...] = ()  # e.g. the chat template's end-of-turn token


class TargetRunner(abc.ABC):
    """The engine seam: turns token ids into unshifted aux states and the pre-norm last hidden.

    Called by `RunnerEagle3TargetModel.generate_batch` with a validated, right-padded batch; the
    runner never shifts, encodes or validates ids. It captures exactly the canonical aux layer ids
    it was built with.
    """

    @abc.abstractmethod
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        """Run one micro-batch through the target engine. A vision-language runner also takes
        `images: ImageInputs` (checked against the rows' placeholders first); a text runner is
        never handed any."""

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """The generated tokens (stop token included, prompt excluded) for each prompt."""
        raise NotImplementedError(f"{type(self).__name__} does not generate text")

    def shutdown(self) -> None:  # noqa: B027 -- optional: a model in this process holds nothing
        """Stop the engine and free what it holds (nothing to do for an in-process model)."""

    @property
    def handoff_overflows(self) -> int:
        """Requests whose captured states took the engine's slow way back to this process
        (vLLM's shared-memory ring full: a file each); 0 where there is none."""
        return 0


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
        vision: ImageTokens | None = None,
    ) -> None:
        self.runner = runner
        # A vision-language target: how its processor expands an image into placeholder
        # tokens; None: a text target, which refuses images.
        self.vision = vision
        self.self_check = self_check
        self.num_hidden_layers = num_hidden_layers
        self.vocab_size = vocab_size
        self._aux_layer_ids = validate_aux_layer_ids(aux_layer_ids, num_hidden_layers)
        self._embedding = embedding
        self._head = head
        self.max_length = max_length
        self.draft_vocab = draft_vocab
        self.encoding = _check_encoding(encoding, draft_vocab)
        self._host_buffers = HostBuffers()  # what captured rows are shifted into

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

    @property
    def device(self) -> torch.device:
        """The engine's device: where the backend's own modules (embedding, head) live, and
        where `generate_batch` returns supervision unless asked for another."""
        return self._head.lm_head.weight.device

    # no_grad, not inference_mode: a co-located trainer may feed the results to autograd.
    @torch.no_grad()
    def generate_batch(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        loss_mask: torch.Tensor | None = None,
        *,
        encoding: Encoding | None = None,
        device: torch.device | str | None = None,
        checked: bool = False,
        images: ImageInputs | None = None,
    ) -> Eagle3TargetBatch:
        """Supervision for one right-padded micro-batch, shifted (docs/contract.md, "Shift").
        `checked`: the caller already ran `validate_micro_batch` on these inputs in this process
        (a pool replica checks each micro-batch before merging them), so it is not run again.

        Inputs may sit on the CPU or on the engine's device. Every tensor of the batch comes
        back on `device` (default: the engine's, for a co-located trainer; a pool replica asks
        for "cpu", ready for the object store): docs/contract.md, "Where tensors live".

        `images`: a vision-language target's images of these rows (RGB bytes at the size its
        processor resizes them to, docs/contract.md "Images"), whose placeholder tokens
        `input_ids` already holds.

        It is `finish_batch(run_engine(...))`: a pool replica runs the two halves on two
        threads, so the engine runs the next micro-batch while the host finishes this one.
        """
        encoding = _check_encoding(encoding or self.encoding, self.draft_vocab)
        return self.finish_batch(
            self.run_engine(input_ids, attention_mask, loss_mask, checked=checked,
                            images=images),
            encoding=encoding, device=device)

    @torch.no_grad()
    def run_engine(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   loss_mask: torch.Tensor | None = None, *, checked: bool = False,
                   images: ImageInputs | None = None) -> EngineOutput:
        """The engine's half of `generate_batch`: the input checks (unless `checked`) and the
        runner, nothing else."""
        if loss_mask is None:
            loss_mask = attention_mask
        if not checked:
            self.validate(input_ids, attention_mask, loss_mask, images)
        out = (self.runner.run(input_ids, attention_mask) if images is None
               else self.runner.run(input_ids, attention_mask, images=images))
        out.check_shape(*input_ids.shape)
        return EngineOutput(input_ids, attention_mask, loss_mask, out)

    def validate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                 loss_mask: torch.Tensor, images: ImageInputs | None = None) -> None:
        """Refuse a micro-batch this target cannot serve (ids, masks, length, and its images
        against the rows' placeholder tokens), saying what is wrong."""
        validate_micro_batch(input_ids, attention_mask, loss_mask, vocab_size=self.vocab_size,
                             max_length=self.max_length)
        validate_images(images, input_ids, attention_mask, self.vision)

    @torch.no_grad()
    def finish_batch(self, engine_output: EngineOutput, *, encoding: Encoding | None = None,
                     device: torch.device | str | None = None) -> Eagle3TargetBatch:
        """The host's half of `generate_batch`: the self-check, the shift and the encoding of
        what `run_engine` returned, on `device` (as in `generate_batch`)."""
        encoding = _check_encoding(encoding or self.encoding, self.draft_vocab)
        device = self.device if device is None else torch.device(device)
        # Rows are shifted into host buffers that `device` and the head's device copy from
        # without the host waiting: the buffers are reused only once those copies are done.
        with self._host_buffers.use(readers=(device, self.device)) as empty:
            return self._supervision(engine_output, encoding, device, empty)

    def _supervision(self, engine_output: EngineOutput, encoding: Encoding, device: torch.device,
                     empty: EmptyHost) -> Eagle3TargetBatch:
        """`finish_batch`'s work, with host tensors from `empty`."""
        out = engine_output.runner_output
        # The shift runs where the runner left its states; the masks follow them there.
        input_ids, attention_mask, loss_mask = hand_over(
            (engine_output.input_ids, engine_output.attention_mask, engine_output.loss_mask),
            out.device)
        if self.self_check and out.next_token_ids is not None:
            check_greedy_tokens(out.next_token_ids, out.final_states(attention_mask), self._head)
        fields = out.shifted(input_ids, attention_mask, loss_mask, empty)
        if out.positions is not None:  # unshifted, like the attention mask; 0 on padding
            fields["positions"] = out.positions.to(attention_mask.device).masked_fill(
                attention_mask == 0, 0)
        last_hidden = fields.pop("last_hidden")
        layers = len(self._aux_layer_ids)
        if encoding == "last_hidden":
            return Eagle3TargetBatch(**to_device({**fields, "last_hidden": last_hidden}, device),
                                     num_aux_layers=layers)
        # Head-derived encodings are decoded on the head's device, a chunk of tokens at a time,
        # straight into their place on `device`.
        has_next = next_position_mask(attention_mask).to(device).unsqueeze(-1)
        no_next = has_next.logical_not()  # (not `~`: see shift_left_by_one)
        fields = to_device(fields, device)
        if encoding == "logits":
            logits = head_logits(last_hidden, self._head, device).masked_fill_(no_next, 0)
            return Eagle3TargetBatch(**fields, logits=logits, num_aux_layers=layers)
        probs, position_mask = draft_target_from_hidden(last_hidden, self._head,
                                                        self.draft_vocab, device)
        return Eagle3TargetBatch(
            **fields,
            target_probs=probs.masked_fill_(no_next, 0),
            position_mask=position_mask & has_next.squeeze(-1),
            num_aux_layers=layers,
        )

    def shutdown(self) -> None:
        """Stop the engine and free what it holds."""
        self.runner.shutdown()

    def complete(self, prompts: list[list[int]], sampling: Sampling) -> list[list[int]]:
        """Generate continuations of token-id prompts with the target (checked first)."""
        validate_prompts(prompts, vocab_size=self.vocab_size, max_length=self.max_length,
                         max_new_tokens=sampling.max_new_tokens)
        return self.runner.complete(prompts, sampling)


def _check_encoding(encoding: str, draft_vocab: DraftVocab | None) -> Encoding:
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown target encoding {encoding!r}; choose one of {ENCODINGS}")
    if encoding == "target_probs" and draft_vocab is None:
        raise ValueError("the target_probs encoding needs a draft_vocab (a DraftVocab)")
    return encoding  # type: ignore[return-value]
