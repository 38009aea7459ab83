"""The images of a micro-batch, as they travel to the engine (docs/contract.md, "Images").

A vision-language micro-batch carries its rows' token ids with every image already expanded to
its placeholder tokens (one `image_token_id` per merged patch), and beside them each image as
RGB bytes at the size the target's processor resizes it to (`smart_resize`: sides multiples of
patch x merge, within its pixel bounds). The engine turns them into its vision tower's input
itself -- the HF backend with the checkpoint's image processor (whose resize is then the
identity), vLLM with its own processor -- and puts the tower's features at the placeholders;
the draft never sees pixels (it reads the placeholder token's own embedding there, as vLLM's
proposer feeds it).

Why bytes and not the processor's `pixel_values`: vLLM takes images, not pixel values, and the
bytes are 8x fewer (`3 H W` uint8 against `2 x 3 H W` float32 for Qwen2-VL's two temporal
copies of each patch), in exchange for the engine normalising and patching them itself.

Like `target_batch`, this module imports nothing of eagle_ray, so every layer may import it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch


@dataclasses.dataclass
class ImageInputs:
    """Images of a `[B, S]` micro-batch in row order, then in order within each row.

    `pixels [P]` uint8: every image's `H x W x 3` RGB bytes, one image after another;
    `image_sizes [I, 2]`: each image's (height, width); `images_per_row [B]`: how many of the
    `I` images each row holds (rows without images hold 0).
    """

    pixels: torch.Tensor
    image_sizes: torch.Tensor
    images_per_row: torch.Tensor

    def __post_init__(self) -> None:
        pixels, sizes, per_row = self.pixels, self.image_sizes, self.images_per_row
        if not (isinstance(pixels, torch.Tensor) and pixels.dim() == 1
                and pixels.dtype == torch.uint8):
            raise ValueError(f"pixels must be a uint8 tensor [bytes] (RGB, row-major), got "
                             f"{_describe(pixels)}")
        for name, t, dims in (("image_sizes", sizes, 2), ("images_per_row", per_row, 1)):
            if not (isinstance(t, torch.Tensor) and t.dim() == dims
                    and not t.is_floating_point() and t.dtype != torch.bool):
                raise ValueError(f"{name} must be an integer tensor of {dims} dimension(s), "
                                 f"got {_describe(t)}")
        if sizes.shape[1:] != (2,) or bool((sizes <= 0).any()) or bool((per_row < 0).any()):
            raise ValueError("image_sizes must be [images, 2] positive (height, width) and "
                             "images_per_row non-negative")
        if int(per_row.sum()) != sizes.shape[0]:
            raise ValueError(f"images_per_row adds up to {int(per_row.sum())} images but "
                             f"image_sizes describes {sizes.shape[0]}")
        expected = int((sizes.prod(dim=1) * 3).sum())
        if expected != pixels.shape[0]:
            raise ValueError(f"image_sizes describe {expected} RGB bytes but pixels holds "
                             f"{pixels.shape[0]}")

    @classmethod
    def of_rows(cls, rows: Sequence[Sequence[np.ndarray]]) -> ImageInputs:
        """From each row's images (`H x W x 3` uint8 arrays; rows without images: empty)."""
        images = [np.ascontiguousarray(image, dtype=np.uint8) for row in rows for image in row]
        for image in images:
            if image.ndim != 3 or image.shape[2] != 3:
                raise ValueError(f"an image must be an H x W x 3 RGB array, got shape "
                                 f"{list(image.shape)}")
        flat = (np.concatenate([i.reshape(-1) for i in images]) if images
                else np.zeros(0, np.uint8))
        return cls(torch.from_numpy(flat),
                   torch.tensor([i.shape[:2] for i in images], dtype=torch.long).view(-1, 2),
                   torch.tensor([len(row) for row in rows], dtype=torch.long))

    @property
    def rows(self) -> int:
        return self.images_per_row.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.pixels, self.image_sizes, self.images_per_row))

    def arrays(self) -> list[np.ndarray]:
        """Every image as an `H x W x 3` uint8 array (views of `pixels`), in order."""
        flat = self.pixels.cpu().numpy()
        out, start = [], 0
        for height, width in self.image_sizes.tolist():
            out.append(flat[start:start + height * width * 3].reshape(height, width, 3))
            start += height * width * 3
        return out

    def image_tokens(self, patch_size: int, spatial_merge_size: int) -> list[int]:
        """Placeholder tokens of each image (`image_token_count`)."""
        return [image_token_count(h, w, patch_size, spatial_merge_size)
                for h, w in self.image_sizes.tolist()]

    def image_tokens_per_row(self, patch_size: int, spatial_merge_size: int) -> list[int]:
        """Placeholder tokens each row must hold (`image_tokens`, added up per row)."""
        tokens = self.image_tokens(patch_size, spatial_merge_size)
        counts, start = [], 0
        for n in self.images_per_row.tolist():
            counts.append(sum(tokens[start:start + n]))
            start += n
        return counts

    def select(self, rows: Sequence[int]) -> ImageInputs:
        """The images of `rows` (in that order): a part of a micro-batch."""
        arrays = self.arrays()
        first = [0, *torch.cumsum(self.images_per_row, 0).tolist()]
        return ImageInputs.of_rows([arrays[first[r]:first[r + 1]] for r in rows])

    def to(self, device: torch.device | str) -> ImageInputs:
        return ImageInputs(self.pixels.to(device), self.image_sizes.to(device),
                           self.images_per_row.to(device))

    @staticmethod
    def concat(parts: Sequence[ImageInputs | None], rows_per_part: Sequence[int]
               ) -> ImageInputs | None:
        """The images of micro-batches stacked row-wise (a merged engine call); None where no
        part has any. `rows_per_part` gives the row count of each part (text-only parts too)."""
        if all(p is None for p in parts):
            return None
        filled = [p if p is not None else ImageInputs(
            torch.zeros(0, dtype=torch.uint8), torch.zeros(0, 2, dtype=torch.long),
            torch.zeros(n, dtype=torch.long)) for p, n in zip(parts, rows_per_part, strict=True)]
        return ImageInputs(torch.cat([p.pixels for p in filled]),
                           torch.cat([p.image_sizes for p in filled]),
                           torch.cat([p.images_per_row for p in filled]))


def image_token_count(height: int, width: int, patch_size: int, spatial_merge_size: int) -> int:
    """Placeholder tokens of an image at the processor's size: one per merged patch."""
    side = patch_size * spatial_merge_size
    return (height // side) * (width // side)


# What a micro-batch is everywhere it travels (data -> client -> replica -> engine): input_ids,
# attention_mask, loss_mask [B, S], and a vision-language micro-batch's images as a fourth.
MicroBatch = (tuple[torch.Tensor, torch.Tensor, torch.Tensor]
              | tuple[torch.Tensor, torch.Tensor, torch.Tensor, ImageInputs])


@dataclasses.dataclass(frozen=True)
class ImageTokens:
    """How a vision-language target turns an image into placeholder tokens."""

    image_token_id: int
    patch_size: int
    spatial_merge_size: int


def validate_images(images: ImageInputs | None, input_ids: torch.Tensor,
                    attention_mask: torch.Tensor, vision: ImageTokens | None) -> None:
    """Reject images that do not belong to a micro-batch's rows, saying what is wrong.

    `vision` None: the target takes no images (a text-only target), so a micro-batch that
    carries any is refused."""
    if vision is None:
        if images is not None:
            raise ValueError("this micro-batch carries images but the target is text-only; "
                             "drop the image items from the data or serve a vision-language "
                             "target")
        return
    if images is not None and images.rows != input_ids.shape[0]:
        raise ValueError(f"images_per_row has {images.rows} rows but input_ids has "
                         f"{input_ids.shape[0]}")
    side = vision.patch_size * vision.spatial_merge_size
    if images is not None and bool((images.image_sizes % side != 0).any()):
        raise ValueError(f"image sizes {images.image_sizes.tolist()[:4]} are not multiples of "
                         f"{side} (patch x merge); resize each image with the target's "
                         f"processor (smart_resize) before it travels")
    real = input_ids.masked_fill(attention_mask == 0, -1)
    placeholders = (real == vision.image_token_id).sum(dim=1).tolist()
    expected = ([0] * input_ids.shape[0] if images is None
                else images.image_tokens_per_row(vision.patch_size, vision.spatial_merge_size))
    bad = [row for row, (got, want) in enumerate(zip(placeholders, expected, strict=True))
           if got != want]
    if bad:
        row = bad[0]
        raise ValueError(
            f"row {row} holds {placeholders[row]} image placeholder tokens (id "
            f"{vision.image_token_id}) but its images need {expected[row]} (one per "
            f"{vision.spatial_merge_size}x{vision.spatial_merge_size} merged patch); rows "
            f"{bad[:8]} disagree -- tokenize with the target's own processor and do not "
            f"truncate inside an image")


def processor_size(image_processor, height: int, width: int) -> tuple[int, int]:
    """The (height, width) a Qwen2-VL-family image processor resizes an image of this size to
    (`smart_resize` with its patch x merge factor and pixel bounds): the size an image travels
    at, and a fixed point of the processor."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    size = image_processor.size
    return smart_resize(height, width,
                        factor=image_processor.patch_size * image_processor.merge_size,
                        min_pixels=size["shortest_edge"], max_pixels=size["longest_edge"])


def check_processor_sizes(images: ImageInputs | None, image_processor) -> None:
    """Refuse images that are not at the size `image_processor` resizes them to (the engine
    would resize them again, and their placeholder count would no longer match)."""
    if images is None:
        return
    for index, (height, width) in enumerate(images.image_sizes.tolist()):
        resized = processor_size(image_processor, height, width)
        if resized != (height, width):
            raise ValueError(
                f"image {index} is {height}x{width} but the target's processor resizes it to "
                f"{resized[0]}x{resized[1]}; resize images with the target's own processor "
                f"(eagle_ray.contract.images.processor_size) before they travel")


def _describe(t: object) -> str:
    return (f"{t.dtype} of shape {list(t.shape)}" if isinstance(t, torch.Tensor)
            else type(t).__name__)
