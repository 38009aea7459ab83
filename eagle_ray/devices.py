"""Moving supervision between an engine's device and host memory (docs/contract.md, "Where
tensors live").

A GPU-to-host copy is issued non-blocking (`Tensor.to(..., non_blocking=True)` then writes into
pinned host memory it allocates itself), and every tensor of a batch is waited for with one
stream sync; a pageable `.cpu()` per tensor would block on each.
"""

from __future__ import annotations

import torch


def to_device(tensors: dict[str, torch.Tensor], device: torch.device | str
              ) -> dict[str, torch.Tensor]:
    """The same tensors on `device` (tensors already there are not copied)."""
    device = torch.device(device)
    moved = {name: tensor.to(device, non_blocking=True) for name, tensor in tensors.items()}
    if device.type == "cpu":
        for source in {tensor.device for tensor in tensors.values()}:
            finish_copies(source)
    return moved


def finish_copies(source: torch.device) -> None:
    """Wait for non-blocking copies from `source` issued on its current stream."""
    if _real_gpu(source):
        torch.cuda.current_stream(source).synchronize()


def _real_gpu(device: torch.device) -> bool:
    # False for fake "cuda" tensors on a CPU-only build (the device tests): nothing to wait for.
    return device.type == "cuda" and torch.cuda.is_available()
