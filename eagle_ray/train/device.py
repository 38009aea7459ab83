"""Putting draft training on its device: the precision it trains in, and supervision copied to
the device while the previous step runs.

bf16 autocast keeps fp32 master weights and optimizer state (AdamW steps the fp32 parameters)
while matmuls and attention run in bf16: half the activation memory and the GPU's fast path.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.devices import HandOver, start_hand_over

PRECISIONS: tuple[str, ...] = ("auto", "bf16", "fp32")  # `train.precision`


def autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    """The dtype training autocasts to on `device` (None: fp32 throughout).

    `auto` is bf16 on a GPU that has it, fp32 elsewhere (the CPU's bf16 is slower than its
    fp32). bf16 asked of a GPU without it is an error.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"train.precision must be one of {PRECISIONS}, got {precision!r}")
    if device.type != "cuda":
        return torch.bfloat16 if precision == "bf16" else None
    has_bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
    if precision == "bf16" and not has_bf16:
        raise ValueError(f"train.precision: bf16 needs a GPU with bf16 (Ampere or newer); "
                         f"{torch.cuda.get_device_name(device)} has none: set train.precision "
                         f"to fp32 (TF32 matmuls) or auto")
    return torch.bfloat16 if precision != "fp32" and has_bf16 else None


class DevicePrefetcher:
    """`(host batch, device batch)` pairs; on a GPU the next batch's copy (pinned, on a side
    stream: `devices.start_hand_over`) overlaps the current step. Host batches stay for
    host-side statistics (token counts), which then cost no device sync."""

    def __init__(self, batches: Iterator[Eagle3TargetBatch], device: torch.device) -> None:
        self.batches = batches
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._ahead: tuple[Eagle3TargetBatch, HandOver] | None = None

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __next__(self) -> tuple[Eagle3TargetBatch, Eagle3TargetBatch]:
        host, copies = self._ahead or self._start_copy(next(self.batches))
        self._ahead = None
        device = host.with_tensors(**dict(zip(host.tensors(), copies.result(), strict=True)))
        try:
            self._ahead = self._start_copy(next(self.batches))
        except StopIteration:
            pass
        return host, device

    def _start_copy(self, host: Eagle3TargetBatch) -> tuple[Eagle3TargetBatch, HandOver]:
        return host, start_hand_over(host.tensors().values(), self.device, self.stream)
