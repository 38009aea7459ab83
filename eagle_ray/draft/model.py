"""The EAGLE-3 draft model, its test-time-training (TTT) forward and its loss, in one file.

One Llama-style decoder layer reads `[input_layernorm(embed(token)) ; hidden_norm(hidden)]`
(2H wide into q/k/v), where `hidden` is `fc(aux)` -- the target's three aux states projected
3H_t -> H -- on the first step, and the draft's own pre-norm output on later steps. The layout and
the residual wiring are exactly those of vLLM's `LlamaForCausalLMEagle3`, so an exported draft
computes in vLLM what it computed in training.

TTT (EAGLE-3): step k at slot t predicts token t + k + 2. Its query sits at position t + k and
attends to step 0's keys at positions <= t (real aux states) and to each later step's key at its
own slot (positions t + 1 .. t + k) -- the keys a chain of k drafted tokens sees at inference.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from eagle_ray.contract.losses import FORWARD_KL, SlotLoss
from eagle_ray.draft.attention import AttentionFn, ttt_attention

TTT_STEP_WEIGHT = 0.8  # loss of step k is weighted 0.8 ** k


@dataclasses.dataclass
class DraftConfig:
    """Shape of the draft. `hidden_size` must equal the target's (its embedding is shared)."""

    hidden_size: int
    target_hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (input embedding)
    draft_vocab_size: int  # the draft's output vocabulary
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    num_aux_layers: int = 3
    num_layers: int = 1  # decoder layers: the fused first (`midlayer`), then plain Llama ones

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int,
                    intermediate_size: int | None = None, num_layers: int = 1,
                    num_aux_layers: int = 3) -> DraftConfig:
        """A draft shaped like the target's layers (one: EAGLE-3's usual) reading N of them."""
        t = target_config.get_text_config()
        head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
        rope = getattr(t, "rope_parameters", None) or {}
        return cls(
            hidden_size=t.hidden_size, target_hidden_size=t.hidden_size,
            num_attention_heads=t.num_attention_heads,
            num_key_value_heads=getattr(t, "num_key_value_heads", t.num_attention_heads),
            head_dim=head_dim, intermediate_size=intermediate_size or t.intermediate_size,
            vocab_size=t.vocab_size, draft_vocab_size=draft_vocab_size,
            rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", getattr(t, "rope_theta", 10000.0))),
            max_position_embeddings=getattr(t, "max_position_embeddings", 2048),
            num_layers=num_layers, num_aux_layers=num_aux_layers,
        )


class RMSNorm(nn.Module):
    """The draft's own norm (vLLM's RMSNorm: `w * x / rms(x)`, computed in fp32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Llama (neox-style) rotary embedding. x: [B, heads, S, D]; positions: [B, S]."""
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.float().unsqueeze(1).unsqueeze(-1) * inv_freq  # [B, 1, S, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.narrow(-1, 0, half).float(), x.narrow(-1, half, half).float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftAttention(nn.Module):
    """Attention over step 0's causal keys plus the diagonal keys of later TTT steps.

    Padding needs no mask: rows are right-padded, so a real slot's keys (slots <= t, and its
    own slot) are all real; padded slots only ever see each other and carry no loss.
    """

    def __init__(self, c: DraftConfig, attention: AttentionFn = ttt_attention,
                 width: int = 2) -> None:
        super().__init__()
        self.c = c
        self.attention = attention
        inputs = width * c.hidden_size  # the fused first layer reads [embedding ; hidden]
        self.q_proj = nn.Linear(inputs, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(inputs, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor,
                cache: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
        """x: [B, S, width x H]; cache: keys and values of earlier TTT steps, appended to."""
        c = self.c
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        keys, values = cache
        keys.append(k)
        values.append(v)
        out = self.attention(q, keys, values, 1.0 / math.sqrt(c.head_dim))  # [B, h, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class DraftMLP(nn.Module):
    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    """vLLM's EAGLE-3 `midlayer`: norms on both inputs, residual through the hidden stream."""

    def __init__(self, c: DraftConfig, attention: AttentionFn = ttt_attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, attention)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, embeds, hidden, positions, cache):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = residual + self.self_attn(x, positions, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class DecoderLayer(nn.Module):
    """A draft layer after the first (vLLM's `layers.i`, i >= 1): a pre-norm Llama layer on the
    residual stream, with its own TTT keys and values."""

    def __init__(self, c: DraftConfig, attention: AttentionFn = ttt_attention) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, attention, width=1)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, hidden, positions, cache):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def frozen_embedding(config: DraftConfig, weight: torch.Tensor | None) -> nn.Embedding:
    """The target's token embedding, frozen: a draft reads tokens through it, and vLLM shares
    the target's (no export carries it)."""
    embedding = nn.Embedding(config.vocab_size, config.hidden_size)
    if weight is not None:
        embedding.weight.data.copy_(weight)
    return embedding.requires_grad_(False)


def feature_projection(config: DraftConfig) -> nn.Linear:
    """`fc`: the target's N aux states `[N * H_target]` -> the draft's hidden size."""
    return nn.Linear(config.num_aux_layers * config.target_hidden_size, config.hidden_size,
                     bias=False)


class Eagle3Draft(nn.Module):
    """The draft: frozen target embedding, `fc`, the fused `midlayer` (and `num_layers - 1`
    plain layers after it), `norm`, draft-vocab `lm_head`.

    Chain drafting: step k reads the token drafted by step k - 1 and the hidden state step k - 1
    produced (`step_inputs`, `next_step_hidden`), one draft forward per drafted token.
    `peagle.PEagleDraft` changes those two hooks and nothing else."""

    kind, title = "eagle3", "EAGLE-3"  # the config's name, a person's
    drafts_in_parallel = False  # one draft forward per drafted token
    reads_mask_token = False  # its drafted slots read the previous guess
    eagle3_aux_layers = True  # exactly EAGLE-3's three captured layers (vLLM's eagle3 fc)
    vllm_method, vllm_parallel_drafting = "eagle3", False  # vLLM never infers the flag

    @staticmethod
    def passes_per_token(ttt_steps: int, seq: int, anchors_per_row: int) -> float:
        return ttt_steps  # training's draft forwards per supervised token: one per TTT step

    def __init__(self, config: DraftConfig, embedding_weight: torch.Tensor | None = None,
                 attention: AttentionFn = ttt_attention) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = frozen_embedding(config, embedding_weight)
        self.fc = feature_projection(config)
        self.midlayer = DraftLayer(config, attention)
        # Named as vLLM loads them (`midlayer` is its `layers.0`).
        self.layers = nn.ModuleDict({str(i): DecoderLayer(config, attention)
                                     for i in range(1, config.num_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

    def untrained(self, embedding_weight: torch.Tensor | None = None) -> Eagle3Draft:
        """A freshly initialised draft of the same kind and shape (an evaluation's baseline)."""
        return Eagle3Draft(self.config, embedding_weight)

    def forward(self, aux_hidden_states: torch.Tensor, step_input_ids: list[torch.Tensor],
                positions: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Draft-vocabulary logits `[B, S, V_draft]` for each TTT step, over right-padded rows.

        `step_input_ids[k]` `[B, S]` is the token read at step k (`step_inputs`: ground truth in
        training, the previous step's guess when drafting); step 0 reads `fc(aux_hidden_states)`.
        Aux states may come in the engine's dtype (bf16): autocast's `fc` reads them as they are.
        Slot t sits at `positions[t]` (`[B, S]`; None: t) and step k at `positions[t] + k`,
        as vLLM's proposer places a draft's query (a vision-language target's temporal M-RoPE
        index: docs/contract.md, "Images").
        """
        batch, seq = step_input_ids[0].shape
        device = aux_hidden_states.device
        base = (torch.arange(seq, device=device).expand(batch, seq) if positions is None
                else positions.to(device))
        if not torch.is_autocast_enabled(device.type):
            aux_hidden_states = aux_hidden_states.to(self.fc.weight.dtype)
        hidden = first = self.fc(aux_hidden_states)  # [B, S, H]
        caches: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = [
            ([], []) for _ in range(self.config.num_layers)]  # one per layer
        logits = []
        for k, ids in enumerate(step_input_ids):
            out = self.midlayer(self.embed_tokens(ids), hidden, base + k, caches[0])
            for layer, cache in zip(self.layers.values(), caches[1:], strict=True):
                out = layer(out, base + k, cache)
            logits.append(self.lm_head(self.norm(out)))
            hidden = self.next_step_hidden(out, first)
        return logits

    def objective(self, model: nn.Module, aux_hidden_states: torch.Tensor,
                  input_ids: torch.Tensor, loss_mask: torch.Tensor, target_probs: torch.Tensor,
                  position_mask: torch.Tensor, depth: int, positions: torch.Tensor | None = None,
                  loss: SlotLoss = FORWARD_KL
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The TTT loss over `depth` steps reading this kind's `step_inputs` (`ttt_loss`);
        `model` is this draft or its DDP wrapper (the forward runs through it); `positions`:
        the supervision's, where slots do not sit at 0 .. S-1; `loss`: `train.loss`."""
        return ttt_loss(model, aux_hidden_states, input_ids, loss_mask, target_probs,
                        position_mask, depth, self.step_inputs(input_ids, depth), positions,
                        loss)

    def step_inputs(self, input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
        return chain_step_inputs(input_ids, steps)  # the tokens each training step reads

    def next_step_hidden(self, out: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
        """The hidden state step k + 1 reads: the one step k produced."""
        return out

    def propose(self, aux_hidden_states: torch.Tensor, seq: list[int], next_token: int, k: int,
                draft_to_target: torch.Tensor, positions: torch.Tensor | None = None
                ) -> list[int]:
        """`k` draft-vocabulary ids drafted greedily after `seq` + `next_token` (aux states of
        `seq`, `[1, len(seq), N*H]`; `positions` `[1, len(seq)]` where they are not 0 ..),
        as vLLM's EAGLE proposer drafts them: step j reads, at the last slot, the token step
        j - 1 drafted (one forward per token)."""
        step_ids = [torch.tensor([seq[1:] + [next_token]], device=aux_hidden_states.device)]
        drafted: list[int] = []
        for _ in range(k):
            logits = self(aux_hidden_states.float(), step_ids, positions)[-1][0, -1]
            drafted.append(int(logits.argmax()))
            step = shift_left(step_ids[-1], 1)
            step[0, -1] = int(draft_to_target[drafted[-1]])
            step_ids.append(step)
        return drafted


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """`x[:, t + k]` at slot t, zero past the end."""
    if k == 0:
        return x
    seq = x.shape[1]
    return torch.cat([x.narrow(1, k, seq - k), torch.zeros_like(x.narrow(1, 0, k))], dim=1)


def chain_step_inputs(input_ids: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Step k at slot t reads token t + k + 1: the ground truth a chain of k accepted drafts
    would have fed it."""
    return [shift_left(input_ids, k) for k in range(steps)]


def ttt_loss(draft: nn.Module, aux_hidden_states: torch.Tensor, input_ids: torch.Tensor,
             loss_mask: torch.Tensor, target_probs: torch.Tensor, position_mask: torch.Tensor,
             ttt_steps: int, step_input_ids: list[torch.Tensor] | None = None,
             positions: torch.Tensor | None = None, loss: SlotLoss = FORWARD_KL
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted TTT loss over shifted supervision (docs/contract.md, "Shift"), plus per-step
    loss and accuracy `[ttt_steps]` (detached, on the loss's device: reading them is the
    caller's host sync, once per log interval rather than per step).

    Step k at slot t is scored against the target at slot t + k, weighted 0.8 ** k, whatever
    the draft's kind: `step_input_ids` are what each step reads (the draft's `step_inputs`;
    None: EAGLE-3's chain); `loss` scores each slot (`train.loss`). Accuracy is the share of
    supervised slots where the draft's argmax equals the target's argmax within the draft
    vocabulary.
    """
    steps = step_input_ids or chain_step_inputs(input_ids, ttt_steps)
    logits = draft(aux_hidden_states, steps, positions)
    total = torch.zeros((), device=aux_hidden_states.device)
    losses, accuracies = [], []
    seq = input_ids.shape[1]
    for k, step_logits in enumerate(logits):
        # Step k at slot t is scored against slot t + k: views of the targets, not shifted
        # copies; slots past the end have no target.
        step_logits = step_logits.narrow(1, 0, seq - k)
        probs, pmask, lmask = (t.narrow(1, k, seq - k)
                               for t in (target_probs, position_mask, loss_mask))
        # Recomputed in backward: keeps only the [B, S, V_draft] logits per step, not their
        # fp32 log-probabilities and products (about 5x the bytes in bf16).
        step_loss = checkpoint(loss.mean, step_logits, probs, pmask, lmask,
                               use_reentrant=False)
        total = total + TTT_STEP_WEIGHT**k * step_loss
        counted = (lmask.bool() & pmask.bool())
        hits = (step_logits.argmax(-1) == probs.argmax(-1)) & counted
        losses.append(step_loss.detach())
        accuracies.append(hits.sum() / counted.sum().clamp_min(1))
    return total, torch.stack(losses), torch.stack(accuracies).float()
