"""The images of a micro-batch, as the target's own processor emitted them (docs/contract.md,
"Images").

A vision-language micro-batch carries its rows' token ids with every image already expanded to
its placeholder tokens (the processor's work: one `image_token_id` per merged patch), and beside
them the processor's output: every image's patches and its patch grid. The engine replaces the
placeholders' embeddings with the vision tower's features; the draft never sees pixels (it reads
the placeholder token's own embedding there, as vLLM's proposer feeds it).

Like `target_batch`, this module imports nothing of eagle_ray, so every layer may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch


@dataclasses.dataclass
class ImageInputs:
    """Images of a `[B, S]` micro-batch in row order, then in order within each row.

    `pixel_values [P, D]`: every image's flattened patches, one after another (Qwen2-VL's
    processor layout); `image_grid_thw [I, 3]`: each image's (temporal, height, width) patch
    grid, so image `i` owns `prod(image_grid_thw[i])` rows of `pixel_values`; `images_per_row
    [B]`: how many of the `I` images each row holds (rows without images hold 0).
    """

    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor
    images_per_row: torch.Tensor

    def __post_init__(self) -> None:
        pixels, grid, per_row = self.pixel_values, self.image_grid_thw, self.images_per_row
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 2
                and pixels.is_floating_point()):
            raise ValueError(f"pixel_values must be a float tensor [patches, patch_dim], got "
                             f"{_describe(pixels)}")
        if not (isinstance(grid, torch.Tensor) and grid.dim() == 2 and grid.shape[1] == 3
                and not grid.is_floating_point()):
            raise ValueError(f"image_grid_thw must be an integer tensor [images, 3], got "
                             f"{_describe(grid)}")
        if not (isinstance(per_row, torch.Tensor) and per_row.dim() == 1
                and not per_row.is_floating_point()):
            raise ValueError(f"images_per_row must be an integer tensor [rows], got "
                             f"{_describe(per_row)}")
        if bool((grid <= 0).any()) or bool((per_row < 0).any()):
            raise ValueError("image_grid_thw must be positive and images_per_row non-negative")
        if int(per_row.sum()) != grid.shape[0]:
            raise ValueError(f"images_per_row adds up to {int(per_row.sum())} images but "
                             f"image_grid_thw describes {grid.shape[0]}")
        patches = int(grid.prod(dim=1).sum())
        if patches != pixels.shape[0]:
            raise ValueError(f"image_grid_thw describes {patches} patches but pixel_values holds "
                             f"{pixels.shape[0]}; pass the processor's output unchanged")

    @property
    def rows(self) -> int:
        return self.images_per_row.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.pixel_values, self.image_grid_thw, self.images_per_row))

    def image_tokens_per_row(self, spatial_merge_size: int) -> list[int]:
        """Placeholder tokens each row must hold: one per merged patch of each of its images."""
        tokens = (self.image_grid_thw.prod(dim=1) // spatial_merge_size**2).tolist()
        counts, start = [], 0
        for n in self.images_per_row.tolist():
            counts.append(sum(tokens[start:start + n]))
            start += n
        return counts

    def select(self, rows: Sequence[int]) -> ImageInputs:
        """The images of `rows` (in that order): a part of a micro-batch split for a retry."""
        per_image_patches = self.image_grid_thw.prod(dim=1).tolist()
        first_image = [0, *torch.cumsum(self.images_per_row, 0).tolist()]
        first_patch = [0, *torch.cumsum(self.image_grid_thw.prod(dim=1), 0).tolist()]
        images = [i for r in rows for i in range(first_image[r], first_image[r + 1])]
        patches = [p for i in images for p in range(first_patch[i],
                                                   first_patch[i] + per_image_patches[i])]
        return ImageInputs(self.pixel_values[patches], self.image_grid_thw[images],
                           self.images_per_row[list(rows)])

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixel_values.to(device), self.image_grid_thw.to(device),
                           self.images_per_row.to(device))

    @staticmethod
    def concat(parts: Sequence[ImageInputs | None], rows_per_part: Sequence[int]
               ) -> ImageInputs | None:
        """The images of micro-batches stacked row-wise (a merged engine call); None where no
        part has any. `rows_per_part` gives the row count of each part (text-only parts too)."""
        if all(p is None for p in parts):
            return None
        present = [p for p in parts if p is not None]
        dtype, width = present[0].pixel_values.dtype, present[0].pixel_values.shape[1]
        empty = ImageInputs(torch.zeros(0, width, dtype=dtype),
                            torch.zeros(0, 3, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        filled = [p if p is not None else ImageInputs(
            empty.pixel_values, empty.image_grid_thw, torch.zeros(n, dtype=torch.long))
            for p, n in zip(parts, rows_per_part, strict=True)]
        return ImageInputs(torch.cat([p.pixel_values for p in filled]),
                           torch.cat([p.image_grid_thw for p in filled]),
                           torch.cat([p.images_per_row for p in filled]))


def validate_images(images: ImageInputs | None, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, *, image_token_id: int | None,
                    spatial_merge_size: int) -> None:
    """Reject images that do not belong to a micro-batch's rows, saying what is wrong.

    `image_token_id` None: the target takes no images (a text-only target), so a micro-batch
    that carries any, or holds a placeholder token, is refused."""
    if image_token_id is None:
        if images is not None:
            raise ValueError("this micro-batch carries images but the target is text-only; "
                             "drop the image items from the data or serve a vision-language "
                             "target")
        return
    real = input_ids.masked_fill(attention_mask == 0, -1)
    placeholders = (real == image_token_id).sum(dim=1).tolist()
    expected = ([0] * input_ids.shape[0] if images is None
                else images.image_tokens_per_row(spatial_merge_size))
    if images is not None and images.rows != input_ids.shape[0]:
        raise ValueError(f"images_per_row has {images.rows} rows but input_ids has "
                         f"{input_ids.shape[0]}")
    bad = [(row, got, want) for row, (got, want) in enumerate(zip(placeholders, expected,
                                                                 strict=True)) if got != want]
    if bad:
        row, got, want = bad[0]
        raise ValueError(
            f"row {row} holds {got} image placeholder tokens (id {image_token_id}) but its images "
            f"need {want} (one per {spatial_merge_size}x{spatial_merge_size} merged patch); "
            f"rows {[b[0] for b in bad][:8]} disagree -- tokenize with the target's own processor "
            f"and do not truncate inside an image")


def _describe(t: object) -> str:
    return (f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor)
            else type(t).__name__)
