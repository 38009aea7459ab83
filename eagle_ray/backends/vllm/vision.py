"""Image micro-batches on the vLLM backend: engine arguments, prompts, and M-RoPE positions.

A micro-batch's rows hold every image already expanded to its placeholder tokens
(docs/contract.md, "Images"). vLLM 0.32 always expands a prompt's placeholders itself
(`BaseMultiModalProcessor._apply_prompt_updates` replaces each `<|image_pad|>` with the image's
tokens and has no way to see that a prompt is expanded already), so each image's run of
placeholders goes to vLLM as one token (`collapse_placeholders`), with the image beside it as
a PIL image, and the runner checks that the engine's expanded prompt is the row again
(`check_expanded`): a disagreement (a processor that resized an image) fails loudly instead
of shifting every state after the image.

Positions: the temporal M-RoPE index of each token, computed by vLLM's rule
(`Qwen2VLForConditionalGeneration.get_mrope_input_positions`): text continues from the largest
index so far, and an image's tokens all share the index it starts at.

Imports vLLM nowhere (PIL only where images are built).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from eagle_ray.contract.images import ImageInputs, ImageTokens
from eagle_ray.data.tokenizer_files import check_tokenizer

# Where transformers 5 looks for a video processor's settings, in order (the Qwen2-VL-family
# processors vLLM builds always load one; `BaseVideoProcessor.get_video_processor_dict`).
VIDEO_PROCESSOR_FILES = ("video_preprocessor_config.json", "preprocessor_config.json")


def checkpoint_image_processor(model_path: str | Path, vllm_kwargs: Mapping[str, Any] | None,
                               trust_remote_code: bool = False) -> Any:
    """The checkpoint's image processor (what image sizes are checked against), after checking
    that vLLM can build the checkpoint's processor: it needs the tokenizer, and settings for
    the video processor the processor class always holds."""
    from transformers import AutoImageProcessor

    check_tokenizer(model_path, vllm_kwargs, "vLLM's image processing")
    folder = Path(model_path)
    processor_config = folder / "processor_config.json"
    nested = (processor_config.exists()
              and "video_processor" in json.loads(processor_config.read_text()))
    if folder.is_dir() and not nested and not any((folder / name).exists()
                                                  for name in VIDEO_PROCESSOR_FILES):
        raise ValueError(
            f"{folder} has no video processor settings (processor_config.json's "
            f"\"video_processor\", or {' / '.join(VIDEO_PROCESSOR_FILES)}), and vLLM's "
            f"Qwen2-VL-family processor cannot be built without them, even for images; save "
            f"the image processor's settings beside the weights "
            f"(AutoImageProcessor.from_pretrained(path).save_pretrained(path))")
    return AutoImageProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code)


def vision_engine_kwargs(engine_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """`vllm.LLM` arguments of a vision-language target's engine: videos refused (the
    torchvision stand-ins process images only; `torchvision_shim`), and no multimodal
    processor cache unless asked for (training rarely shows an image twice, and the cache
    holds up to 4 GiB in two processes by default). vLLM sizes its encoder budget to the
    largest image by itself."""
    limits = dict(engine_kwargs.get("limit_mm_per_prompt") or {})
    if limits.get("video"):
        raise ValueError(f"vllm_kwargs limit_mm_per_prompt={limits}: the vLLM backend captures "
                         f"images only (video prompts are refused); remove the video limit")
    limits["video"] = 0
    kwargs = {**engine_kwargs, "limit_mm_per_prompt": limits}
    kwargs.setdefault("mm_processor_cache_gb", 0)
    return kwargs


def collapse_placeholders(ids: Sequence[int], tokens_per_image: Sequence[int],
                          image_token_id: int) -> list[int]:
    """`ids` with each image's run of placeholder tokens (`tokens_per_image`, in order) as one
    placeholder: the prompt vLLM expands again."""
    out: list[int] = []
    images = iter(tokens_per_image)
    i = 0
    while i < len(ids):
        if ids[i] != image_token_id:
            out.append(ids[i])
            i += 1
            continue
        count = next(images, None)
        if count is None or list(ids[i:i + count]) != [image_token_id] * count:
            raise ValueError(f"a row's image placeholders at position {i} are not one "
                             f"contiguous run per image (its images need {list(tokens_per_image)} "
                             f"tokens each); tokenize with the target's own processor")
        out.append(image_token_id)
        i += count
    return out


def image_prompts(input_ids: torch.Tensor, lengths: Sequence[int], images: ImageInputs | None,
                  vision: ImageTokens | None) -> list[dict[str, Any]]:
    """One vLLM prompt per row: token ids, and for a row with images its collapsed
    placeholders and its images (`multi_modal_data`)."""
    rows = [row[:n].tolist() for row, n in zip(input_ids, lengths, strict=True)]
    if images is None or not int(images.images_per_row.sum()):
        return [{"prompt_token_ids": ids} for ids in rows]
    if vision is None:
        raise ValueError("this micro-batch carries images but the vLLM target is text-only")
    from PIL import Image

    arrays = images.arrays()
    tokens = images.image_tokens(vision.patch_size, vision.spatial_merge_size)
    prompts, first = [], 0
    for ids, count in zip(rows, images.images_per_row.tolist(), strict=True):
        if not count:
            prompts.append({"prompt_token_ids": ids})
            continue
        prompts.append({
            "prompt_token_ids": collapse_placeholders(ids, tokens[first:first + count],
                                                      vision.image_token_id),
            "multi_modal_data": {"image": [Image.fromarray(a, "RGB")
                                           for a in arrays[first:first + count]]},
        })
        first += count
    return prompts


def check_expanded(outputs: Sequence[Any], input_ids: torch.Tensor,
                   lengths: Sequence[int]) -> None:
    """The prompts as vLLM expanded them (its `RequestOutput.prompt_token_ids`) must be the
    micro-batch's rows, token for token (else its states would not sit at the rows' places)."""
    for row, (output, n) in enumerate(zip(outputs, lengths, strict=True)):
        got, want = output.prompt_token_ids, input_ids[row, :n].tolist()
        if got is not None and list(got) != want:
            raise RuntimeError(
                f"vLLM expanded row {row}'s image placeholders to {len(got)} tokens where the "
                f"row holds {n}: its processor resized an image or counts its tokens otherwise "
                f"(images must travel at the size the target's processor resizes them to)")


def temporal_positions(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       images: ImageInputs | None, vision: ImageTokens | None
                       ) -> torch.Tensor | None:
    """`[B, S]`: each token's temporal M-RoPE index as vLLM computes it (module docstring), 0 on
    padding; None for a micro-batch without images (the draft's default 0 .. S-1)."""
    if images is None or vision is None:
        return None
    side = vision.patch_size * vision.spatial_merge_size
    grids = iter([(h // side, w // side) for h, w in images.image_sizes.tolist()])
    # Built as lists and turned into one tensor: an element write per token costs a dispatch.
    rows = []
    for ids, n in zip(input_ids.tolist(), attention_mask.sum(dim=1).tolist(), strict=True):
        row: list[int] = []
        index, i = 0, 0
        while i < n:
            if ids[i] != vision.image_token_id:
                row.append(index)
                index, i = index + 1, i + 1
                continue
            height, width = next(grids)
            row += [index] * (height * width)
            index, i = index + max(height, width), i + height * width
        rows.append(row + [0] * (len(ids) - n))
    return torch.tensor(rows, dtype=input_ids.dtype, device=input_ids.device)
