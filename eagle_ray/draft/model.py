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

from eagle_ray.supervision import soft_cross_entropy

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

    @classmethod
    def from_target(cls, target_config, draft_vocab_size: int,
                    intermediate_size: int | None = None) -> DraftConfig:
        """A draft shaped like one layer of the target (the usual EAGLE-3 choice)."""
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
    angles = positions.float()[:, None, :, None] * inv_freq  # [B, 1, S, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftAttention(nn.Module):
    """Attention over step 0's causal keys plus the diagonal keys of later TTT steps."""

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.c = c
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, attention_mask: torch.Tensor,
                cache: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """x: [B, S, 2H]; cache: (k, v) of earlier TTT steps, appended to here."""
        c = self.c
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, c.num_attention_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, c.num_key_value_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta)
        groups = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        cache.append((k, v))
        scale = 1.0 / math.sqrt(c.head_dim)
        k0, v0 = cache[0]
        scores = (q @ k0.transpose(-1, -2)) * scale  # [B, h, S, S] against step 0
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        allowed = causal[None, None] & attention_mask.bool()[:, None, None, :]
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        diagonal = [(q * kj).sum(-1, keepdim=True) * scale for kj, _ in cache[1:]]  # [B,h,S,1]
        weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1)
        weights = weights.to(q.dtype)
        out = weights[..., :seq] @ v0
        for j, (_, vj) in enumerate(cache[1:]):
            out = out + weights[..., seq + j : seq + j + 1] * vj
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

    def __init__(self, c: DraftConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = DraftMLP(c)

    def forward(self, embeds, hidden, positions, attention_mask, cache):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        residual = residual + self.self_attn(x, positions, attention_mask, cache)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Draft(nn.Module):
    """The draft: frozen target embedding, `fc`, one `midlayer`, `norm`, draft-vocab `lm_head`."""

    def __init__(self, config: DraftConfig, embedding_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        if embedding_weight is not None:
            self.embed_tokens.weight.data.copy_(embedding_weight)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(config.num_aux_layers * config.target_hidden_size,
                            config.hidden_size, bias=False)
        self.midlayer = DraftLayer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)

    def forward(self, aux_hidden_states: torch.Tensor, step_input_ids: list[torch.Tensor],
                attention_mask: torch.Tensor) -> list[torch.Tensor]:
        """Draft-vocabulary logits `[B, S, V_draft]` for each TTT step.

        `step_input_ids[k]` `[B, S]` is the token read at step k (ground truth in training, the
        previous step's guess when drafting); step 0 reads `fc(aux_hidden_states)`.
        """
        batch, seq = step_input_ids[0].shape
        base = torch.arange(seq, device=aux_hidden_states.device).expand(batch, seq)
        hidden = self.fc(aux_hidden_states.to(self.fc.weight.dtype))
        cache: list[tuple[torch.Tensor, torch.Tensor]] = []
        logits = []
        for k, ids in enumerate(step_input_ids):
            hidden = self.midlayer(self.embed_tokens(ids), hidden, base + k, attention_mask,
                                   cache)
            logits.append(self.lm_head(self.norm(hidden)))
        return logits


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """`x[:, t + k]` at slot t, zero past the end."""
    if k == 0:
        return x
    out = torch.zeros_like(x)
    out[:, :-k] = x[:, k:]
    return out


def ttt_loss(draft: nn.Module, aux_hidden_states: torch.Tensor, input_ids: torch.Tensor,
             attention_mask: torch.Tensor, loss_mask: torch.Tensor, target_probs: torch.Tensor,
             position_mask: torch.Tensor, ttt_steps: int
             ) -> tuple[torch.Tensor, list[float], list[float]]:
    """Weighted TTT loss over shifted supervision (docs/contract.md, "Shift"), plus per-step
    loss and accuracy.

    Accuracy is the share of supervised slots where the draft's argmax equals the target's
    argmax within the draft vocabulary.
    """
    steps = [shift_left(input_ids, k) for k in range(ttt_steps)]
    logits = draft(aux_hidden_states, steps, attention_mask)
    total = torch.zeros((), device=aux_hidden_states.device)
    losses, accuracies = [], []
    for k, step_logits in enumerate(logits):
        probs, pmask, lmask = (shift_left(t, k) for t in (target_probs, position_mask, loss_mask))
        loss = soft_cross_entropy(step_logits, probs, pmask, lmask)
        total = total + TTT_STEP_WEIGHT**k * loss
        counted = (lmask.bool() & pmask.bool())
        hits = (step_logits.argmax(-1) == probs.argmax(-1)) & counted
        losses.append(float(loss.detach()))
        accuracies.append(float(hits.sum()) / max(int(counted.sum()), 1))
    return total, losses, accuracies
