"""Micro-batches to replicas and supervision back, as numpy arrays (in the Ray object store).

Ray stores numpy arrays out of band and readers on the same node map them without a copy; torch
tensors would be copied on read (unless RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set everywhere).
bf16 has no numpy dtype, so it travels as its int16 bit pattern with the torch dtype alongside.
With `encoding_dtype="fp8"` the hidden states travel as e4m3 bytes with their scales
(`eagle_ray.contract.fp8`) and are dequantised on read, into the dtype the engine produced.
Tensors read back are views of read-only object-store memory: clone before writing into them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import numpy as np
import ray
import torch

from eagle_ray.contract.fp8 import FP8, dequantize_fp8, encode_batch
from eagle_ray.contract.target_batch import Eagle3TargetBatch

# Inputs up to this size are passed by value in each replica call, larger ones put in the object
# store once (Ray inlines arguments under 100 KiB; 64 KiB is ~2.7k tokens of int64 and masks).
INLINE_INPUT_BYTES = 64 * 1024
_VIEW_AS = {torch.bfloat16: torch.int16, FP8: torch.uint8}
# {field: (array, torch dtype name)}, or (e4m3 bytes, dtype to restore, fp32 scales) for fp8.
Payload = dict[str, tuple]
LAYERS_KEY = "num_aux_layers"  # the payload's one entry that is no tensor


def pack_inputs(*tensors: torch.Tensor) -> tuple[np.ndarray, ...] | ray.ObjectRef:
    """A micro-batch's tensors as the replica call's argument: copies of the arrays when small
    (a put costs more than they do), else one object-store ref. Either way a snapshot taken now:
    every attempt, however late, sends what was submitted even if the caller reuses its tensors."""
    arrays = tuple(t.detach().cpu().numpy() for t in tensors)
    if sum(a.nbytes for a in arrays) <= INLINE_INPUT_BYTES:
        return tuple(a.copy() for a in arrays)
    return ray.put(arrays)


def batch_to_numpy(batch: Eagle3TargetBatch, encoding_dtype: str = "auto") -> Payload:
    """Every set field as numpy; no copy for CPU tensors, unless quantised to fp8; and the
    aux layer count (`LAYERS_KEY`)."""
    payload: Payload = {name: (_to_numpy(values), _dtype_name(dtype)) if scales is None
                        else (_to_numpy(values), _dtype_name(dtype), scales.numpy())
                        for name, values, scales, dtype in encode_batch(batch, encoding_dtype)}
    payload[LAYERS_KEY] = (batch.num_aux_layers,)
    return payload


def batch_from_numpy(payload: Payload) -> Eagle3TargetBatch:
    """Inverse of `batch_to_numpy`; zero-copy views where the arrays allow it."""
    tensors = {}
    (layers,) = payload[LAYERS_KEY]
    with warnings.catch_warnings():
        # Object-store arrays are read-only; torch warns that writes would be undefined.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (array, dtype_name, *scales) in _fields(payload):
            dtype = getattr(torch, dtype_name)
            if scales:
                tensors[name] = dequantize_fp8(torch.from_numpy(array).view(FP8),
                                               torch.from_numpy(scales[0]), dtype)
                continue
            tensor = torch.from_numpy(array)
            tensors[name] = tensor.view(dtype) if tensor.dtype != dtype else tensor
    return Eagle3TargetBatch(**tensors, num_aux_layers=layers)


def _fields(payload: Payload) -> Iterator[tuple[str, tuple]]:
    return ((name, entry) for name, entry in payload.items() if name != LAYERS_KEY)


def payload_arrays(payload: Payload) -> list[np.ndarray]:
    """The payload's value arrays (what travels in bulk), field by field."""
    return [entry[0] for _, entry in _fields(payload)]


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.contiguous()
    view = _VIEW_AS.get(tensor.dtype)
    return (tensor.view(view) if view is not None else tensor).numpy()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
