"""Moving supervision between an engine's device and host memory (docs/contract.md, "Where
tensors live").

A GPU-to-host copy goes into pinned memory, non-blocking, and every tensor of a batch is
waited for with one stream sync; a pageable `.cpu()` per tensor would block on each.
"""

from __future__ import annotations

import torch


def to_device(tensors: dict[str, torch.Tensor], device: torch.device | str
              ) -> dict[str, torch.Tensor]:
    """The same tensors on `device` (tensors already there are not copied)."""
    device = torch.device(device)
    moved, pending = {}, set()
    for name, tensor in tensors.items():
        if tensor.device == device:
            moved[name] = tensor
        elif device.type == "cpu" and tensor.device.type == "cuda":
            moved[name] = empty_host(tensor.shape, tensor.dtype, tensor.device).copy_(
                tensor, non_blocking=True)
            pending.add(tensor.device)
        else:
            moved[name] = tensor.to(device, non_blocking=True)
    for source in pending:
        finish_copies(source)
    return moved


def empty_host(shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
               source: torch.device) -> torch.Tensor:
    """An uninitialised host tensor to copy `source`'s results into: pinned when `source` is a
    GPU (so the copy runs asynchronously, at full bandwidth)."""
    return torch.empty(shape, dtype=dtype, pin_memory=_real_gpu(source))


def finish_copies(source: torch.device) -> None:
    """Wait for non-blocking copies from `source` issued on its current stream."""
    if _real_gpu(source):
        torch.cuda.current_stream(source).synchronize()


def _real_gpu(device: torch.device) -> bool:
    # False for fake "cuda" tensors on a CPU-only build (the device tests): nothing to pin.
    return device.type == "cuda" and torch.cuda.is_available()
