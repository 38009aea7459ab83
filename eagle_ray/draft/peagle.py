"""P-EAGLE: the EAGLE-3 draft drafting all k tokens in one forward (parallel drafting).

vLLM 0.32 serves it as an `eagle3` draft with `parallel_drafting` (`llm_base_proposer.py`): per
request the draft reads the EAGLE-shifted context with its target features, then the bonus
token with the last verified token's features, then k - 1 slots holding a mask token and the
features `fc(mask_hidden)` (one learned vector, projected by the same `fc`), at consecutive
positions under causal attention; slot j's output is draft token j + 1. So the model is
EAGLE-3's with `mask_hidden`, and training is EAGLE-3's TTT forward with two inputs changed:
step k >= 1 reads the mask token (not the ground truth) and `fc(mask_hidden)` (not step k - 1's
output). Its attention -- step 0's keys up to the anchor, then the anchor's own earlier steps --
is exactly what each mask slot attends to in vLLM, and step k at anchor t is scored against the
target at t + k, as depth k of the references' COD sequences is (P-EAGLE, arXiv 2602.01469;
speculators `models/peagle`, SpecForge `peagle.py`): every anchor at every depth, weighted
0.8 ** k, which is what COD's subsampling with ratio 0.8 gives in expectation.
"""

from __future__ import annotations

import torch
from torch import nn

from eagle_ray.draft.attention import AttentionFn, ttt_attention
from eagle_ray.draft.model import DraftConfig, Eagle3Draft


class PEagleDraft(Eagle3Draft):
    """EAGLE-3's draft plus `mask_hidden` (standard normal, trainable, as every reference
    initialises it) and the mask token's id, which its slots read through the frozen target
    embedding."""

    kind, title = "peagle", "P-EAGLE (parallel drafting)"
    drafts_in_parallel = True
    reads_mask_token = True
    eagle3_aux_layers = False  # any number: vLLM sizes its fc by `num_aux_hidden_states`
    vllm_parallel_drafting = True  # an eagle3 draft that vLLM runs in one forward only if told

    def __init__(self, config: DraftConfig, mask_token_id: int,
                 embedding_weight: torch.Tensor | None = None,
                 attention: AttentionFn = ttt_attention) -> None:
        super().__init__(config, embedding_weight, attention)
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary "
                             f"[0, {config.vocab_size})")
        self.mask_token_id = mask_token_id
        # vLLM reads it as (1, N * H_target) and views it flat.
        self.mask_hidden = nn.Parameter(
            torch.randn(1, config.num_aux_layers * config.target_hidden_size))

    def untrained(self, embedding_weight: torch.Tensor | None = None) -> PEagleDraft:
        return PEagleDraft(self.config, self.mask_token_id, embedding_weight)

    def step_inputs(self, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Step 0 reads the context's tokens; every later step the mask token."""
        return [input_ids] + [torch.full_like(input_ids, self.mask_token_id)] * (steps - 1)

    def next_step_hidden(self, out: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """Every mask slot reads `fc(mask_hidden)`, not the step before's output (a parameter
        beside `fc`'s weight: same dtype and device; autocast casts as it casts the aux states)."""
        return self.fc(self.mask_hidden).expand_as(first)

    def propose(self, aux_hidden_states: torch.Tensor, seq: list[int], next_token: int, k: int,
                draft_to_target: torch.Tensor) -> list[int]:
        """`k` draft-vocabulary ids from one pass: the bonus slot and k - 1 mask slots after
        `seq` + `next_token`, each its slot's greedy choice (nothing drafted is read back)."""
        ids = torch.tensor([seq[1:] + [next_token]], device=aux_hidden_states.device)
        logits = self(aux_hidden_states.float(), self.step_inputs(ids, k))
        return [int(step[0, -1].argmax()) for step in logits]


def resolve_mask_token_id(configured: int | None, tokenizer, vocab_size: int) -> int:
    """The mask token a P-EAGLE draft reads (`draft.mask_token_id`): as configured, else the
    first id past the tokenizer where the vocabulary has room (unused by any text: Qwen's
    padded vocabularies), else the pad token -- what SpecForge and speculators choose."""
    if configured is not None:
        if not 0 <= configured < vocab_size:
            raise ValueError(f"draft.mask_token_id {configured} is outside the target's "
                             f"vocabulary [0, {vocab_size}); choose an id no text uses")
        return configured
    if len(tokenizer) < vocab_size:
        return len(tokenizer)
    if tokenizer.pad_token_id is not None:
        return tokenizer.pad_token_id
    raise ValueError("the target's vocabulary has no free id and its tokenizer no pad token: "
                     "set draft.mask_token_id to a token id no text uses (a reserved one)")
