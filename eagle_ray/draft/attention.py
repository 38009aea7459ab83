"""The draft's attention kernels: TTT attention in memory linear in the sequence, its
materialised reference, and the one `scaled_dot_product_attention` call every draft kind makes
(`grouped_query_attention`), in a form CUDA's memory-efficient kernels take."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

HALF_PRECISION = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256  # flash attention's largest head dim on sm80+ (cuDNN's too)


def attention_dtype(q: torch.Tensor) -> torch.dtype:
    """The dtype an attention call computes in: autocast's where it is on (SDPA is on its
    lower-precision list), else the query's."""
    device = q.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else q.dtype


def grouped_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                            scale: float, is_causal: bool = False,
                            mask: torch.Tensor | None = None) -> torch.Tensor:
    """`scaled_dot_product_attention` over grouped-query K/V `[B, h_kv, L, D]`, always in a
    form one of CUDA's memory-efficient kernels takes -- every draft attention calls it.

    Flash attention takes grouped-query heads but no explicit mask, only fp16 / bf16 and head
    dims up to 256 (TTT attention pads the head dim by up to 10); the memory-efficient kernel
    takes a mask, fp32 and any head dim, but not grouped-query heads (cuDNN attention, which
    PyTorch may prefer on Hopper, takes both: there the repeat costs a K/V copy and is
    harmless). Anything else falls to the math kernel, which materialises fp32 scores
    `[B, h, Lq, Lk]` (12 GiB per layer for the 8B DFlash recipe). So where flash cannot take the
    call, the key / value heads are repeated to the query heads (`[B, h, L, D]`: small beside
    the scores it avoids). The CPU's
    flash kernel takes all of these, so only this rule (tests/draft/test_attention_kernels.py)
    keeps a CUDA run off the math kernel; `eagle-ray plan` measures the kernel CUDA picks
    (`train.memory.cuda_attention_kernels`).
    """
    groups = q.shape[1] // k.shape[1]
    flash_takes_it = (mask is None and attention_dtype(q) in HALF_PRECISION
                      and q.shape[-1] <= FLASH_MAX_HEAD_DIM)
    if groups > 1 and not flash_takes_it:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=k.shape[1] != q.shape[1])


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  scale: float) -> torch.Tensor:
    """TTT attention without a `[S, S]` score matrix: memory linear in S for a fixed step count.

    q: [B, h, S, D]; keys / values: one `[B, h_kv, S, D]` per TTT step so far (grouped-query
    K/V are copied per head only where a CUDA kernel needs it: `grouped_query_attention`). The
    query at slot t attends to step 0's keys at slots <= t and to step j's key at slot t
    (j >= 1), in one softmax -- what `reference_ttt_attention` computes with materialised scores.

    Step 0's causal part goes through `scaled_dot_product_attention` (flash / memory-efficient
    kernels on GPU and CPU). The diagonal keys join its softmax through one extra "sink" key,
    placed before slot 0, that every query sees: query t's logit for it is the log-sum-exp of
    its diagonal logits (carried in two spare head-dim columns as a high and a low part, so bf16
    loses nothing), and its value is an indicator column. The kernel's output then holds the
    causal part already weighted by the full softmax, plus the diagonal part's total weight,
    which scales the diagonal values' own softmax mix. A dummy query in front keeps the causal
    mask aligned. Everything stays differentiable through public ops.
    """
    k0, v0 = keys[0], values[0]
    if len(keys) == 1:
        return grouped_query_attention(q, k0, v0, scale=scale, is_causal=True)
    batch, heads, seq, dim = q.shape
    kv_heads = k0.shape[1]
    grouped = q.view(batch, kv_heads, heads // kv_heads, seq, dim)
    logits = torch.stack([(grouped * k.unsqueeze(2)).sum(-1) for k in keys[1:]], dim=-1)
    logits = logits.to(torch.promote_types(q.dtype, torch.float32)) * scale  # [B,kv,g,S,steps]
    diagonal = sum(w.unsqueeze(-1) * v.unsqueeze(2) for w, v in zip(
        logits.softmax(-1).to(q.dtype).unbind(-1), values[1:], strict=True))  # [B,kv,g,S,D]
    sink_logit = (logits.logsumexp(-1) / scale).reshape(batch, heads, seq, 1)
    high = sink_logit.to(q.dtype)
    low = (sink_logit - high).to(q.dtype)
    spare = -(dim + 2) % 8  # kernels want the head dim a multiple of 8
    q_ext = F.pad(torch.cat([q, high, low], dim=-1), (0, spare, 1, 0))  # [B, h, 1 + S, D']
    sink = k0.new_zeros(batch, kv_heads, 1, dim + 2 + spare)
    k_ext = torch.cat([sink.index_fill(-1, _range(dim, dim + 2, q), 1),
                       F.pad(k0, (0, 2 + spare))], dim=2)
    v_ext = torch.cat([sink.index_fill(-1, _range(dim, dim + 1, q), 1),
                       F.pad(v0, (0, 2 + spare))], dim=2)
    out = grouped_query_attention(q_ext, k_ext, v_ext, scale=scale, is_causal=True
                                  ).narrow(2, 1, seq)
    diagonal_weight = out.narrow(-1, dim, 1)
    return out.narrow(-1, 0, dim) + diagonal_weight * diagonal.view(batch, heads, seq, dim)


def _range(start: int, stop: int, like: torch.Tensor) -> torch.Tensor:
    return torch.arange(start, stop, device=like.device)


def reference_ttt_attention(q: torch.Tensor, keys: list[torch.Tensor],
                            values: list[torch.Tensor], scale: float) -> torch.Tensor:
    """`ttt_attention` written out: `[B, h, S, S]` scores plus one diagonal column per later
    step, one softmax. Memory grows with `steps * S**2`; the tests' oracle and the benchmark's
    "before"."""
    groups = q.shape[1] // keys[0].shape[1]
    keys = [k.repeat_interleave(groups, dim=1) for k in keys]
    values = [v.repeat_interleave(groups, dim=1) for v in values]
    seq = q.shape[2]
    scores = (q @ keys[0].transpose(-1, -2)) * scale  # [B, h, S, S] against step 0
    causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, torch.finfo(scores.dtype).min)
    diagonal = [(q * k).sum(-1, keepdim=True) * scale for k in keys[1:]]  # [B, h, S, 1] each
    weights = torch.softmax(torch.cat([scores, *diagonal], dim=-1).float(), dim=-1).to(q.dtype)
    out = weights[..., :seq] @ values[0]
    for j, v in enumerate(values[1:]):
        out = out + weights[..., seq + j : seq + j + 1] * v
    return out


AttentionFn = Callable[[torch.Tensor, list[torch.Tensor], list[torch.Tensor], float],
                       torch.Tensor]
