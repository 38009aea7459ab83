"""Peak tensor memory of a piece of code on any device, real or fake.

`TensorMemoryProbe` counts the bytes of every tensor storage created while it is active and
subtracts them when the storage is freed, so its `peak` is what a caching allocator would have to
hold at once (allocator rounding and fragmentation aside). It sees through PyTorch's dispatcher,
so it works on the CPU (where torch keeps no allocator statistics) and under `FakeTensorMode`:
`eagle-ray plan` runs a training step at a recipe's full shape on fake tensors -- no memory, no
compute -- and reads its activation peak here; tests check linear-memory claims on the CPU.
Storages that exist before the probe starts (weights, inputs) are not counted.

`cuda_attention_kernels` makes attention allocate what CUDA's kernel for each call would: the
CPU runs every `scaled_dot_product_attention` call through its flash kernel, while CUDA sends a
call neither of its memory-efficient kernels takes to the math kernel, whose fp32 scores are
often the largest tensor of a step.

Example:
    >>> with TensorMemoryProbe() as probe:                        # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> probe.peak  # bytes                                        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from eagle_ray.draft.attention import FLASH_MAX_HEAD_DIM, HALF_PRECISION, attention_dtype


class TensorMemoryProbe(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while the probe is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0  # bytes of counted storages still alive
        self.peak = 0  # most bytes alive at once
        self._counted: set[int] = set()  # ids of storages counted and not yet freed

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)  # one Python object per live storage (torch preserves it)
        if key in self._counted:  # a view or an in-place result
            return
        nbytes = storage.nbytes()
        self._counted.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, nbytes)

    def _free(self, key: int, nbytes: int) -> None:
        self._counted.discard(key)
        self.live -= nbytes


def cuda_sdpa_kernel(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None) -> str:
    """The kernel CUDA's `scaled_dot_product_attention` picks for a call on sm80+ without
    cuDNN attention (which PyTorch prefers on Hopper with a recent cuDNN, and which takes masks
    and grouped-query heads: where it runs, this rule overstates a masked grouped-query call):
    flash takes fp16 / bf16 without an explicit mask up to head dim 256, grouped-query heads
    included; the memory-efficient kernel takes masks and fp32, but not grouped-query heads;
    the rest goes to math."""
    grouped = k.shape[1] != q.shape[1]
    half = attention_dtype(q) in HALF_PRECISION
    if half and mask is None and q.shape[-1] <= FLASH_MAX_HEAD_DIM:
        return "flash"
    return "math" if grouped else "efficient"


@contextlib.contextmanager
def cuda_attention_kernels() -> Iterator[list[str]]:
    """Within it, `F.scaled_dot_product_attention` allocates (on any device, fake tensors too)
    what the kernel CUDA picks would: the math kernel's fp32 scores, softmax and grouped-query
    K/V copies (it upcasts half inputs), the memory-efficient kernel's mask turned into a bias of
    the compute dtype. Yields the kernels picked, call by call."""
    original = F.scaled_dot_product_attention
    picked: list[str] = []

    def as_on_cuda(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                   enable_gqa=False):
        kernel = cuda_sdpa_kernel(q, k, attn_mask)
        picked.append(kernel)
        if kernel == "math":
            return _math_attention(q, k, v, attn_mask, is_causal, scale)
        if kernel == "efficient" and attn_mask is not None and attn_mask.dtype == torch.bool:
            bias = torch.zeros(attn_mask.shape, dtype=attention_dtype(q), device=q.device)
            attn_mask = bias.masked_fill(~attn_mask, -math.inf)
        return original(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = as_on_cuda
    try:
        yield picked
    finally:
        F.scaled_dot_product_attention = original


def _math_attention(q, k, v, mask, is_causal, scale):
    """CUDA's math kernel: half inputs upcast to fp32 (PyTorch's default since 2.5), scores
    materialised and kept for the backward."""
    dtype = attention_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        if mask is not None and mask.dtype == torch.bool:  # CUDA turns it into a bias first
            mask = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, -math.inf)
        out, _ = torch.ops.aten._scaled_dot_product_attention_math(
            q.float(), k.float(), v.float(), mask, 0.0, is_causal, scale=scale,
            enable_gqa=k.shape[1] != q.shape[1])
    return out.to(dtype)
