"""Peak tensor memory of a piece of code on any device, real or fake.

`TensorMemoryProbe` counts the bytes of every tensor storage created while it is active and
subtracts them when the storage is freed, so its `peak` is what a caching allocator would have to
hold at once (allocator rounding and fragmentation aside). It sees through PyTorch's dispatcher,
so it works on the CPU (where torch keeps no allocator statistics) and under `FakeTensorMode`:
`eagle-ray plan` runs a training step at a recipe's full shape on fake tensors -- no memory, no
compute -- and reads its activation peak here; tests check linear-memory claims on the CPU.
Storages that exist before the probe starts (weights, inputs) are not counted.

Example:
    >>> with TensorMemoryProbe() as probe:                        # doctest: +SKIP
    ...     loss = model(x).sum(); loss.backward()
    >>> probe.peak  # bytes                                        # doctest: +SKIP
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
