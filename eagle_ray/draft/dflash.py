"""DFlash: a block draft that drafts all k tokens in one forward, conditioned only on several
target layers (arXiv 2602.06036; z-lab's `DFlashDraftModel`, SpecForge `core/dflash.py`).

vLLM 0.32 serves it as `method: dflash` (`qwen3_dflash.py`): the target's N aux states of the
verified tokens go through `fc` and `hidden_norm` once; each draft layer projects them into its
own keys (`k_norm`, RoPE at their positions) and values -- the context never passes a layer's
norm, MLP or query path. The queries are one block, `[bonus, mask x k]` at the positions after
the context, through Qwen3 layers (per-head `q_norm` / `k_norm`) attending to the context and,
non-causally, to the whole block; block slot j's output is the draft token at its own position.

Training (the references' objective): anchors are answer positions; each anchor's block holds
its token and `block_size - 1` masks, sees the context strictly before the anchor and its own
block, and slot j is scored against the target at the anchor + j, weighted exp(-(j - 1) / gamma),
a weighted mean over every block's supervised slots -- or D-PACE's weights (`BlockWeighting`).
Here the target is the target's next-token distribution over the draft vocabulary, scored with
`train.loss` as every kind is (soft cross-entropy by default), where the references use the hard
next token; `block_size` is `train.ttt_steps + 1`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle_ray.contract.losses import (
    DPACE_ALPHA,
    FORWARD_KL,
    SlotLoss,
    dpace_weights,
    masked_mean,
    top_token_confidence,
)
from eagle_ray.draft.attention import grouped_query_attention
from eagle_ray.draft.model import (
    DraftConfig,
    DraftMLP,
    RMSNorm,
    feature_projection,
    frozen_embedding,
    rotate,
)

ANCHORS_PER_ROW = 512  # SpecForge's default `num_anchors`


def default_decay_gamma(block_size: int) -> float:
    """The paper's loss decay for a block size (7 for 16, 5 for 10, 4 for 8 and below)."""
    return 7.0 if block_size >= 16 else 5.0 if block_size >= 10 else 4.0


@dataclasses.dataclass(frozen=True)
class BlockWeighting:
    """How the block loss weights its slots (`draft.loss_weighting`).

    `decay`: slot j's weight is exp(-(j - 1) / gamma) (`decay_gamma`; None: the paper's for the
    block size), a weighted mean over the supervised slots. `dpace`: D-PACE (arXiv 2605.18810;
    speculators `dpace_loss_decay`, its DFlash default, and ModelOpt's): each slot's weight is
    its share of the block's expected accepted length, from the draft's confidence in the
    target's top token at every slot of the block (`losses.dpace_weights`, smoothed by
    `dpace_alpha`); the weighted sum is divided by the supervised slots' count, as speculators'
    `loss_function` divides it (the weights' sum would cancel the credit they carry)."""

    kind: Literal["decay", "dpace"] = "decay"
    decay_gamma: float | None = None
    dpace_alpha: float = DPACE_ALPHA

    def __post_init__(self) -> None:
        if self.kind not in ("decay", "dpace"):
            raise ValueError(f"unknown block weighting {self.kind!r}; choose decay or dpace")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"dpace_alpha must be in (0, 1], got {self.dpace_alpha}")

    def combine(self, per_slot: list[torch.Tensor], valid: list[torch.Tensor],
                means: list[torch.Tensor], confidence: list[torch.Tensor]) -> torch.Tensor:
        """The block loss from slot j's per-block losses, masks and (D-PACE) confidences
        `[B, A]` and its mean loss over the supervised blocks, j = 1 .. depth."""
        if self.kind == "dpace":
            losses, masks = torch.stack(per_slot, -1), torch.stack(valid, -1)
            weights = dpace_weights(torch.stack(confidence, -1), masks, self.dpace_alpha)
            return (weights * losses * masks).sum() / masks.sum().clamp_min(1)
        gamma = self.decay_gamma or default_decay_gamma(len(per_slot) + 1)
        weighted = counted = torch.zeros((), device=per_slot[0].device)
        for j, (mean, mask) in enumerate(zip(means, valid, strict=True), start=1):
            slots = mask.sum()
            weight = math.exp(-(j - 1) / gamma)
            weighted = weighted + weight * mean * slots
            counted = counted + weight * slots
        return weighted / counted.clamp_min(1e-6)


DECAY = BlockWeighting()  # today's default: the paper's exponential decay


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys and values are the context's, then the block's own."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, h_kv, L, D]` keys (normed per head, rotated) and values of `x` `[B, L, H]`."""
        c = self.c
        batch, length, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(batch, length, c.num_key_value_heads, c.head_dim))
        v = self.v_proj(x).view(batch, length, c.num_key_value_heads, c.head_dim)
        return rotate(k.transpose(1, 2), positions, c.rope_theta), v.transpose(1, 2)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                context: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor | None
                ) -> torch.Tensor:
        c = self.c
        batch, length, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, length, c.num_attention_heads, c.head_dim))
        q = rotate(q.transpose(1, 2), positions, c.rope_theta)
        k, v = self.keys_values(x, positions)
        out = grouped_query_attention(
            q, torch.cat([context[0], k], dim=2), torch.cat([context[1], v], dim=2),
            scale=1.0 / math.sqrt(c.head_dim), mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class DFlashLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the context features."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, hidden, positions, context, context_positions, mask):
        context_kv = self.self_attn.keys_values(context, context_positions)
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, context_kv,
                                         mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def block_attention_mask(anchors: torch.Tensor, context_len: int, block_size: int
                         ) -> torch.Tensor:
    """`[B, 1, A * bs, S + A * bs]`: block i's queries see context slots <= its anchor and
    every slot of block i (non-causal), nothing of the other blocks."""
    batch, count = anchors.shape
    slots = torch.arange(context_len, device=anchors.device)
    sees_context = (slots <= anchors.unsqueeze(-1)).unsqueeze(2)  # [B, A, 1, S]
    own_block = torch.eye(count, dtype=torch.bool, device=anchors.device)
    own_block = own_block.repeat_interleave(block_size, dim=1)  # [A, A * bs]
    mask = torch.cat([sees_context.expand(-1, -1, block_size, -1),
                      own_block.view(1, count, 1, -1).expand(batch, -1, block_size, -1)], dim=-1)
    return mask.view(batch, 1, count * block_size, -1)


def sample_anchors(loss_mask: torch.Tensor, position_mask: torch.Tensor, limit: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchors `[B, A]`, kept `[B, A]`): up to `limit` slots per row, drawn uniformly among
    those whose next token is an answer token with a target, ascending; A = min(limit, S), so
    no host sync (a row with fewer fills its rest with dropped anchors at slot 0)."""
    valid = loss_mask.bool() & position_mask.bool()
    seq = valid.shape[1]
    count = min(limit, seq)
    draw = torch.where(valid, torch.rand(valid.shape, device=valid.device), 2.0)
    picked = draw.argsort(dim=1)[:, :count]
    order = torch.where(valid.gather(1, picked), picked, seq + picked).sort(dim=1).values
    kept = order < seq
    return torch.where(kept, order, 0), kept


class DFlashDraft(nn.Module):
    """Frozen target embedding, `fc` + `hidden_norm` over the aux states, `num_layers` Qwen3
    layers (`layers.i`, as vLLM loads them), `norm`, draft-vocab `lm_head`."""

    kind, title = "dflash", "DFlash (block drafting)"
    drafts_in_parallel = True
    reads_mask_token = True
    eagle3_aux_layers = False  # any number (`dflash_config.target_layer_ids`)
    vllm_method, vllm_parallel_drafting = "dflash", False  # the method drafts in parallel

    @staticmethod
    def passes_per_token(ttt_steps: int, seq: int, anchors_per_row: int) -> float:
        """Its blocks' slots per row token: `min(anchors, seq) x block_size / seq`."""
        return min(anchors_per_row, seq) * (ttt_steps + 1) / seq

    def __init__(self, config: DraftConfig, mask_token_id: int,
                 embedding_weight: torch.Tensor | None = None,
                 anchors_per_row: int = ANCHORS_PER_ROW,
                 weighting: BlockWeighting = DECAY) -> None:
        super().__init__()
        if not 0 <= mask_token_id < config.vocab_size:
            raise ValueError(f"mask_token_id {mask_token_id} is outside the target's vocabulary "
                             f"[0, {config.vocab_size})")
        self.config, self.mask_token_id = config, mask_token_id
        self.anchors_per_row, self.weighting = anchors_per_row, weighting
        self.embed_tokens = frozen_embedding(config, embedding_weight)
        self.fc = feature_projection(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

    def untrained(self, embedding_weight: torch.Tensor | None = None) -> DFlashDraft:
        return DFlashDraft(self.config, self.mask_token_id, embedding_weight,
                           self.anchors_per_row, self.weighting)

    def forward(self, aux_hidden_states: torch.Tensor, anchors: torch.Tensor,
                block_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits `[B, A, bs, V_draft]` of blocks `block_ids` `[B, A, bs]`,
        block i at positions `anchors[:, i] + 1 ...`, seeing the aux states `[B, S, N*H_t]` of
        slots <= `anchors[:, i]`."""
        batch, count, size = block_ids.shape
        seq = aux_hidden_states.shape[1]
        device = aux_hidden_states.device
        if not torch.is_autocast_enabled(device.type):
            aux_hidden_states = aux_hidden_states.to(self.fc.weight.dtype)
        context = self.hidden_norm(self.fc(aux_hidden_states))
        context_positions = torch.arange(seq, device=device).expand(batch, seq)
        positions = (anchors.unsqueeze(-1) + 1 + torch.arange(size, device=device))
        positions = positions.view(batch, count * size)
        mask = block_attention_mask(anchors, seq, size)
        hidden = self.embed_tokens(block_ids.view(batch, count * size))
        for layer in self.layers:
            hidden = layer(hidden, positions, context, context_positions, mask)
        return self.lm_head(self.norm(hidden)).view(batch, count, size, -1)

    def objective(self, model: nn.Module, aux_hidden_states: torch.Tensor,
                  input_ids: torch.Tensor, loss_mask: torch.Tensor, target_probs: torch.Tensor,
                  position_mask: torch.Tensor, depth: int, positions: torch.Tensor | None = None,
                  loss: SlotLoss = FORWARD_KL
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The block loss over shifted supervision (docs/contract.md, "Shift"), blocks of
        `depth + 1`, each slot scored with `loss` (`train.loss`) and weighted by `weighting`;
        per-depth loss and accuracy `[depth]` (detached). `model` is this draft or its DDP
        wrapper (the forward runs through it).

        An anchor at slot b reads context slots <= b; its block holds `input_ids[b]` (the token
        at position b + 1, vLLM's bonus token) and masks; slot j predicts the token at position
        b + 1 + j, whose target distribution is slot b + j - 1's, supervised where that token
        is an answer token (`loss_mask[b + j]`)."""
        if positions is not None:  # the job config refuses it first; a library user may not
            raise ValueError("DFlash drafts train on text targets only: vLLM drafts text-only "
                             "beside a vision-language target for parallel drafting")
        anchors, kept = sample_anchors(loss_mask, position_mask, self.anchors_per_row)
        block = torch.full((*anchors.shape, depth + 1), self.mask_token_id,
                           dtype=input_ids.dtype, device=input_ids.device)
        block[..., 0] = input_ids.gather(1, anchors)
        logits = model(aux_hidden_states, anchors, block)
        seq, vocab = input_ids.shape[1], target_probs.shape[-1]
        per_slot, valids, confidences, accuracies = [], [], [], []
        answers, targeted = loss_mask.bool(), position_mask.bool()
        for j in range(1, depth + 1):
            source, label = anchors + j - 1, anchors + j
            valid = (kept & (label < seq) & answers.gather(1, label.clamp(max=seq - 1))
                     & targeted.gather(1, source.clamp(max=seq - 1)))
            probs = target_probs.gather(
                1, source.clamp(max=seq - 1).unsqueeze(-1).expand(-1, -1, vocab))
            step_logits = logits[:, :, j]
            # Recomputed in backward: only the logits are kept, not their fp32 softmax.
            per_slot.append(checkpoint(loss.per_slot, step_logits, probs, use_reentrant=False))
            valids.append(valid)
            if self.weighting.kind == "dpace":
                confidences.append(top_token_confidence(step_logits, probs))
            hits = (step_logits.argmax(-1) == probs.argmax(-1)) & valid
            accuracies.append(hits.sum() / valid.sum().clamp_min(1))
        means = [masked_mean(slot_loss, valid, valid)
                 for slot_loss, valid in zip(per_slot, valids, strict=True)]
        return (self.weighting.combine(per_slot, valids, means, confidences),
                torch.stack(means).detach(), torch.stack(accuracies).float())

    def propose(self, aux_hidden_states: torch.Tensor, seq: list[int], next_token: int, k: int,
                draft_to_target: torch.Tensor) -> list[int]:
        """`k` draft-vocabulary ids from one block `[next_token, mask x k]` after `seq` (aux
        states `[1, len(seq), N*H]`): each mask slot's greedy choice, as vLLM's DFlash proposer
        samples them."""
        device = aux_hidden_states.device
        block = torch.tensor([[[next_token] + [self.mask_token_id] * k]], device=device)
        anchors = torch.tensor([[len(seq) - 1]], device=device)
        logits = self(aux_hidden_states.float(), anchors, block)[0, 0, 1:]
        return [int(i) for i in logits.argmax(-1)]
