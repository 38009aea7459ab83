"""Tiny vision-language targets and image micro-batches for the tests (random weights and
pixels: what is tested is where states and positions go, not what the model sees)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoModelForImageTextToText

from eagle_ray.contract.images import ImageInputs
from eagle_ray.tiny.vision import tiny_vl_config

KINDS = ("qwen2_5_vl", "qwen3_vl")
GRIDS = {0: [(1, 4, 4)], 1: [], 2: [(1, 4, 6), (1, 6, 4)]}  # patch grids of each row (t, h, w)


def tiny_vl_model(kind: str) -> torch.nn.Module:
    """A randomly initialised tiny target of `kind` (seeded), in fp32."""
    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(tiny_vl_config(kind),
                                                   dtype=torch.float32).eval()


def image_rows(config, generator: torch.Generator) -> tuple[list[list[int]], ImageInputs]:
    """Three rows: text, an image, text; text only; text, two images of other sizes, text."""
    vocab = config.get_text_config().vocab_size
    image, start, end = (config.image_token_id, config.vision_start_token_id,
                         config.vision_end_token_id)
    merge = config.vision_config.spatial_merge_size

    def text(n: int) -> list[int]:
        return torch.randint(0, min(vocab, image) - 1, (n,), generator=generator).tolist()

    rows = []
    for row in range(3):
        ids = text(5)
        for t, h, w in GRIDS[row]:
            ids += [start] + [image] * (t * h * w // merge**2) + [end] + text(3)
        rows.append(ids + text(2))
    patch = config.vision_config.patch_size
    images = [[torch.randint(0, 256, (h * patch, w * patch, 3), generator=generator,
                             dtype=torch.uint8).numpy() for _, h, w in GRIDS[row]]
              for row in range(3)]
    return rows, ImageInputs.of_rows(images)


def padded(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    seq = max(map(len, rows))
    ids = torch.zeros(len(rows), seq, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, :len(row)], attention[i, :len(row)] = torch.tensor(row), 1
    return ids, attention


def vllm_temporal_positions(ids: list[int], grids: list[tuple[int, int, int]], image_token: int,
                            merge: int) -> list[int]:
    """The temporal M-RoPE index of each token as vLLM 0.32 computes it
    (`Qwen2VLForConditionalGeneration.get_mrope_input_positions`: text continues from the
    largest index so far; an image's patches share its first index), written out here to check
    the backend against an independent computation."""
    positions: list[int] = []
    index = 0
    grids = iter(grids)
    i = 0
    while i < len(ids):
        if ids[i] != image_token:
            positions.append(index)
            index += 1
            i += 1
            continue
        t, h, w = next(grids)
        grid = np.indices((t, h // merge, w // merge)).reshape(3, -1) + index
        positions += grid[0].tolist()
        index = int(grid.max()) + 1
        i += grid.shape[1]
    return positions


