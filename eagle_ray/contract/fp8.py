"""fp8 supervision (`encoding_dtype: fp8`): hidden states as float8 e4m3 with a scale per token
and per captured layer, half the bytes of bf16 (docs/contract.md, "Encodings").

Each token's slice of each layer (H values) is scaled so its largest magnitude maps to e4m3's
largest finite value (448) and rounded to the nearest e4m3 value; the scale travels as fp32. A
value `x` comes back within `|x| * 2**-4 + scale * 2**-10` (half a unit in the last place of
e4m3's 3-bit mantissa, or half the smallest subnormal step, 2**-9, for values near zero):
`ROUND_TRIP_BOUND`. Only hidden states are quantised (aux and `last_hidden`); ids, masks, logits
and probabilities keep their dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.devices import to_device

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
QUANTISED_FIELDS = ("aux_hidden_states", "last_hidden")
SCALES_SUFFIX = ".scales"
ENCODING_DTYPES = ("auto", "fp8")  # auto: the engine's own dtype (bf16 on GPUs)
# |x - dequantised| <= RELATIVE * |x| + ABSOLUTE * scale, for every value.
ROUND_TRIP_BOUND = (2.0**-4, 2.0**-10)
QUANTISE_CHUNK_TOKENS = 4096  # fp32 working copies span this many tokens at most


def quantize_fp8(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values e4m3 [..., D], scales fp32 [..., D // group_size])` for `x [..., D]`, one scale
    per `group_size` consecutive values of the last axis (a token's slice of one layer),
    computed where `x` is, a chunk of tokens at a time (no fp32 copy of the whole batch)."""
    if x.shape[-1] % group_size:
        raise ValueError(f"the last axis ({x.shape[-1]}) is not a multiple of the group size "
                         f"{group_size}")
    values, scales = [], []
    for chunk in x.reshape(-1, x.shape[-1]).split(QUANTISE_CHUNK_TOKENS):
        groups = chunk.float().reshape(len(chunk), -1, group_size)
        scale = groups.abs().amax(dim=-1, keepdim=True) / FP8_MAX
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # all-zero (padding)
        values.append((groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).reshape(chunk.shape))
        scales.append(scale.squeeze(-1))
    return (torch.cat(values).reshape(x.shape),
            torch.cat(scales).reshape(*x.shape[:-1], -1))


def dequantize_fp8(values: torch.Tensor, scales: torch.Tensor,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8`, in `dtype`."""
    groups = values.float().reshape(*scales.shape, -1) * scales.unsqueeze(-1)
    return groups.reshape(values.shape).to(dtype)


def encode_batch(batch: Eagle3TargetBatch, encoding_dtype: str
                 ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor | None, torch.dtype]]:
    """`(field, values, scales, dtype)` for every set field, in host memory: with
    `encoding_dtype` "fp8" the hidden states as e4m3 values and their scales (one per token and
    layer), quantised where the batch is (on the engine's device, before the copy), every other
    field as it is (scales None); `dtype` is the field's own (what decoding restores). What the
    object store and a supervision cache hold alike."""
    hidden = batch.hidden_size
    encoded: dict[str, torch.Tensor] = {}
    for name, tensor in batch.tensors().items():
        if encoding_dtype == "fp8" and name in QUANTISED_FIELDS:
            encoded[name], encoded[name + SCALES_SUFFIX] = quantize_fp8(tensor.detach(), hidden)
        else:
            encoded[name] = tensor.detach()
    on_host = to_device(encoded, "cpu")
    for name, tensor in batch.tensors().items():
        yield name, on_host[name], on_host.get(name + SCALES_SUFFIX), tensor.dtype
