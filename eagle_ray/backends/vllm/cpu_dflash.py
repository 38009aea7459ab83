"""A fix for DFlash drafts on vLLM 0.32's CPU build: every draft layer's context keys normed with
its own `k_norm`.

vLLM's DFlash model (`vllm/model_executor/models/qwen3_dflash.py`) writes the context's keys and
values into every draft layer's KV cache at once: `DFlashQwen3Model._normalize_context_k` hands
`ops.rms_norm` the keys of all L layers (`[L, num_ctx, nkv, head_dim]`) and the L layers'
`k_norm` weights stacked (`[L, head_dim]`), the weight "selected per layer by the outermost
index". The CPU build's `rms_norm` ignores that index and norms every layer with row 0: draft
layers 1.. attend to context keys normed with layer 0's weight, which training never saw. A
one-layer draft is immune; on the kit's three-layer DFlash draft vLLM accepted a different count
than the simulation on 3 of 16 prompts, and with this fix every prompt agrees
(`scripts/repro_vllm_dflash_acceptance.py`).

`install` (run by the `vllm.general_plugins` entry point in every vLLM process) norms each
layer with its own weight where the CPU kernel drops the index (`stacked_weight_honoured`
checks the kernel itself, so a vLLM that fixes it is left alone). GPU builds are not touched
(not checked here: no GPU was lent). `EAGLE_RAY_CPU_DFLASH_FIX=0` keeps vLLM's code as shipped.
"""

from __future__ import annotations

import os

import torch

SWITCH = "EAGLE_RAY_CPU_DFLASH_FIX"  # "0": keep vLLM's code as shipped
ORIGINAL = "_normalize_context_k_before_eagle_ray"  # where `install` keeps vLLM's method


def normalize_context_k(self, all_k: torch.Tensor) -> torch.Tensor:
    """`DFlashQwen3Model._normalize_context_k`, layer by layer: layer i's keys with layer i's
    `k_norm` (the same kernel, one call per layer)."""
    from vllm import _custom_ops as ops

    normed = torch.empty_like(all_k)
    for layer in range(all_k.shape[0]):
        ops.rms_norm(normed[layer], all_k[layer].contiguous(),
                     self._k_norm_weights[layer].contiguous(), self._rms_norm_eps)
    return normed


def stacked_weight_honoured(layers: int = 3, head_dim: int = 16) -> bool:
    """Whether this build's `rms_norm` norms `[L, ..., head_dim]` with row i of an `[L,
    head_dim]` weight for outer index i, as vLLM's DFlash model expects (CPU tensors)."""
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(layers, 5, 2, head_dim, generator=generator)
    weight = torch.rand(layers, head_dim, generator=generator) + 0.5
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-6)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight[:, None, None]
    return torch.allclose(out, expected, atol=1e-4)


def install() -> bool:
    """Put `normalize_context_k` in place of vLLM's on a CPU build whose kernel drops the layer
    index. False elsewhere, or where `SWITCH` is 0."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or os.environ.get(SWITCH, "1") == "0":
        return False
    if stacked_weight_honoured():
        return False
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    if not hasattr(DFlashQwen3Model, ORIGINAL):
        setattr(DFlashQwen3Model, ORIGINAL, DFlashQwen3Model._normalize_context_k)
    DFlashQwen3Model._normalize_context_k = normalize_context_k
    return True
