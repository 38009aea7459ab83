"""Supervision batches as numpy arrays in the Ray object store.

Ray stores numpy arrays out of band and readers on the same node map them without a copy; torch
tensors would be copied on read (unless RAY_ENABLE_ZERO_COPY_TORCH_TENSORS is set everywhere).
bf16 has no numpy dtype, so it travels as its int16 bit pattern with the torch dtype alongside.
Tensors read back are views of read-only object-store memory: clone before writing into them.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from eagle_ray.target_batch import Eagle3TargetBatch

_VIEW_AS = {torch.bfloat16: torch.int16}


def batch_to_numpy(batch: Eagle3TargetBatch) -> dict[str, tuple[np.ndarray, str]]:
    """`{field: (array, torch dtype name)}` for every set field; no copy for CPU tensors."""
    out = {}
    for name, tensor in batch.tensors().items():
        tensor = tensor.detach().cpu().contiguous()
        view = _VIEW_AS.get(tensor.dtype)
        array = (tensor.view(view) if view is not None else tensor).numpy()
        out[name] = (array, str(tensor.dtype).removeprefix("torch."))
    return out


def batch_from_numpy(payload: dict[str, tuple[np.ndarray, str]]) -> Eagle3TargetBatch:
    """Inverse of `batch_to_numpy`; zero-copy views where the arrays allow it."""
    tensors = {}
    with warnings.catch_warnings():
        # Object-store arrays are read-only; torch warns that writes would be undefined.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (array, dtype_name) in payload.items():
            tensor = torch.from_numpy(array)
            dtype = getattr(torch, dtype_name)
            tensors[name] = tensor.view(dtype) if tensor.dtype != dtype else tensor
    return Eagle3TargetBatch(**tensors)
