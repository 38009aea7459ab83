"""Whether supervision holds only finite values, checked before it leaves a replica.

One NaN or inf in what a trainer learns from makes its gradient NaN, and one such step turns
every draft weight into NaN. An engine produces them without an error of its own: fp16
overflow, a broken kernel, a bad weight shard.

The check costs one reduction per float tensor on the tensor's own device (a sum over each row
in the tensor's dtype: NaN and inf propagate through it, and no temporary the tensor's size is
made; fp16, whose sums overflow at 65504, by its extremes: two reductions) and one host read for
the whole batch. Only rows it flags are looked at element by element, to count NaN, +inf and
-inf exactly: a row of large finite values whose sum overflowed is not refused.
"""

from __future__ import annotations

import dataclasses

import torch

from eagle_ray.contract.target_batch import Eagle3TargetBatch


@dataclasses.dataclass(frozen=True)
class NonFiniteField:
    """A tensor of a batch that holds NaN or inf: its field, the rows (indices in the batch)
    that hold them, and how many of each kind."""

    name: str
    rows: tuple[int, ...]
    nan: int
    posinf: int
    neginf: int

    def __str__(self) -> str:
        return (f"{self.name}: {self.nan} NaN, {self.posinf} +inf, {self.neginf} -inf in "
                f"row(s) {list(self.rows)}")


def suspect_rows(tensor: torch.Tensor) -> torch.Tensor:
    """`[B]` bool on the tensor's device: rows whose reduction is not finite (every row holding
    NaN or inf, and possibly one whose finite values sum past the dtype's range)."""
    dims = tuple(range(1, tensor.dim()))
    if tensor.dtype == torch.float16:  # a sum would overflow; the extremes cannot
        reduced = tensor.amax(dims).float() + tensor.amin(dims).float()
    else:
        reduced = tensor.sum(dims)
    return torch.isfinite(reduced).logical_not()


def nonfinite_fields(batch: Eagle3TargetBatch) -> list[NonFiniteField]:
    """Each float tensor of `batch` that holds NaN or inf (none: an empty list)."""
    floats = {name: t for name, t in batch.tensors().items() if t.is_floating_point()}
    suspects = torch.stack([suspect_rows(t) for t in floats.values()])
    if not bool(suspects.any()):  # the one host read of a finite batch
        return []
    found = []
    for (name, tensor), flagged in zip(floats.items(), suspects.cpu(), strict=True):
        rows = flagged.nonzero().flatten().tolist()
        if not rows:
            continue
        values = tensor[rows]
        nan = values.isnan()
        inf = values.isinf()
        per_row = (nan | inf).flatten(1).any(1).cpu()
        if not bool(per_row.any()):  # large finite values: their sum overflowed
            continue
        found.append(NonFiniteField(
            name, tuple(r for r, bad in zip(rows, per_row.tolist(), strict=True) if bad),
            int(nan.sum()), int((inf & (values > 0)).sum()), int((inf & (values < 0)).sum())))
    return found
