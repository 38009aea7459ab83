"""Image-text chats -> token ids with every image expanded to its placeholder tokens, an
assistant-token loss mask that follows the expansion, and the images as they travel.

A vision-language target's chat template writes one `<|image_pad|>` per image item; its processor
resizes the i-th image (`smart_resize`: sides multiples of patch x merge) and replaces its pad by
one token per merged patch, `(H / side) x (W / side)` copies (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
The assistant turns are located in the template's text as for text chats (`eagle_ray.data.chat`),
their character spans moved by the expansion, and the expanded text tokenised once with offsets:
the mask then covers exactly the answer tokens however many placeholder tokens precede them.
Placeholders never carry loss (the model does not emit them).

Images leave here as the contract carries them (`eagle_ray.contract.images`): RGB bytes at the
size the processor resizes them to, resized as its own resize does (PIL, its resample filter),
so the engine's processor finds nothing left to resize and its pixel values equal those of the
original image. They are decoded where the row is tokenised (a Ray Data worker), never on the
driver; a missing or unreadable image is an `ImageProblem` naming it, which the caller counts.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from eagle_ray.contract.images import ImageInputs, image_token_count, processor_size
from eagle_ray.data.chat import (
    NoAssistantTurn,
    assistant_spans,
    has_generation_markers,
    mask_from_spans,
)

if TYPE_CHECKING:
    from eagle_ray.config import JobConfig

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<|image_pad|>"  # Qwen2-VL / Qwen2.5-VL / Qwen3-VL placeholder
# An image processor's config: its own file, or (transformers 5) a part of the processor's.
IMAGE_PROCESSOR_FILE, PROCESSOR_FILE = "preprocessor_config.json", "processor_config.json"
URL_TIMEOUT_S = 30.0


class ImageProblem(ValueError):
    """An image item the row cannot train with; `status` is the row's `STATUSES` entry."""

    status = "dropped_image_unreadable"

    def __init__(self, image: str, reason: str) -> None:
        super().__init__(f"image {image}: {reason}")
        self.image, self.reason = image, reason


class ImageMissing(ImageProblem):
    status = "dropped_image_missing"


def image_refs(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The image items' sources (path, URL, bytes, ...) of a conversation, in order."""
    return [item["image"] for m in messages if isinstance(m["content"], list)
            for item in m["content"] if item["type"] == "image"]


def with_image_root(messages: Sequence[dict[str, Any]], root: str | None
                    ) -> list[dict[str, Any]]:
    """Messages whose relative image paths are made absolute against `root` (a held-out
    conversation leaves the data's folder for the evaluation's Ray task)."""
    def placed(item: dict[str, Any]) -> dict[str, Any]:
        ref = item.get("image")
        if root is None or item["type"] != "image" or not isinstance(ref, str) \
                or "://" in ref or ref.startswith("data:") or Path(ref).is_absolute():
            return item
        return {**item, "image": str(Path(root) / ref)}

    return [{**m, "content": [placed(item) for item in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def image_problem(messages: Sequence[dict[str, Any]], root: str | Path | None) -> str:
    """Why a conversation's images cannot be read (the first that fails: its source and the
    reason), or "" where every one loads: what the job names for a row it dropped."""
    for ref in image_refs(messages):
        try:
            load_image(ref, root)
        except ImageProblem as e:
            return str(e)
    return ""


def text_only(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages with every content list that holds text items only as its texts joined: what
    templates render alike (Qwen-VL's), and the only form some take (a text model's, or one
    whose assistant turns are strings). Image items stay as they are."""
    return [{**m, "content": "".join(item["text"] for item in m["content"])}
            if isinstance(m["content"], list)
            and all(item["type"] == "text" for item in m["content"]) else m
            for m in messages]


def describe(ref: Any) -> str:
    """An image source as a log line names it (bytes by size, not content)."""
    if isinstance(ref, dict):
        return str(ref.get("path") or f"<{len(ref.get('bytes') or b'')} image bytes>")
    if isinstance(ref, bytes | bytearray):
        return f"<{len(ref)} image bytes>"
    text = str(ref)
    return text if len(text) <= 200 else text[:100] + "..."


def load_image(ref: Any, root: str | Path | None = None):
    """`ref` decoded to an RGB PIL image: a local path (relative ones against `root`), an
    http(s) URL, a `data:image/...;base64,` string, encoded bytes, or a `{"bytes", "path"}`
    record (Hugging Face datasets' image column in Parquet). Raises `ImageProblem`."""
    from PIL import Image, ImageOps

    name = describe(ref)
    try:
        if isinstance(ref, dict):
            ref = ref.get("bytes") or ref.get("path")
        if isinstance(ref, bytes | bytearray):
            image = Image.open(io.BytesIO(ref))
        elif isinstance(ref, str) and ref.startswith(("http://", "https://")):
            import httpx

            image = Image.open(io.BytesIO(httpx.get(ref, timeout=URL_TIMEOUT_S,
                                                    follow_redirects=True).content))
        elif isinstance(ref, str) and ref.startswith("data:image/"):
            image = Image.open(io.BytesIO(base64.b64decode(ref.split(",", 1)[1])))
        elif isinstance(ref, str) and ref:
            path = Path(ref) if root is None or Path(ref).is_absolute() else Path(root) / ref
            if not path.is_file():
                raise ImageMissing(str(path), "no such file")
            image = Image.open(path)
        else:
            raise ImageMissing(name, "the image item names no image")
        image.load()  # decode now: a truncated file fails here, not in the processor
        return ImageOps.exif_transpose(image).convert("RGB")
    except ImageProblem:
        raise
    except Exception as e:  # PIL's UnidentifiedImageError, OSError, httpx errors
        raise ImageProblem(name, f"unreadable ({type(e).__name__}: {e})") from e


@dataclasses.dataclass
class VisionProcessor:
    """What tokenising image chats needs from a vision-language target's processor."""

    tokenizer: Any
    image_processor: Any
    chat_template: str
    image_token: str
    image_token_id: int
    patch_size: int
    merge_size: int

    @classmethod
    def from_processor(cls, processor) -> VisionProcessor:
        """From a loaded `AutoProcessor` (Qwen2-VL's API: `image_processor.merge_size`,
        `image_token`)."""
        return cls.from_parts(processor.tokenizer, processor.image_processor,
                              processor.chat_template or processor.tokenizer.chat_template,
                              getattr(processor, "image_token", IMAGE_TOKEN))

    @classmethod
    def from_parts(cls, tokenizer, image_processor, chat_template: str | None,
                   image_token: str = IMAGE_TOKEN) -> VisionProcessor:
        token_id = tokenizer.convert_tokens_to_ids(image_token)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ValueError(f"the tokenizer has no {image_token!r} token")
        if not chat_template:
            raise ValueError("the processor has no chat template")
        return cls(tokenizer, image_processor, chat_template, image_token, int(token_id),
                   int(image_processor.patch_size), int(image_processor.merge_size))

    def apply_chat_template(self, messages, **kwargs):
        """The tokenizer's rendering with the processor's template (the one that knows image
        items), so `eagle_ray.data.chat` locates turns in it as in any template."""
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template,
                                                  **kwargs)

    def resized(self, image) -> np.ndarray:
        """`image` (PIL, RGB) as `H x W x 3` uint8 at the size the processor resizes it to,
        resized as the processor's own PIL resize does."""
        from PIL import Image

        height, width = processor_size(self.image_processor, image.height, image.width)
        if (height, width) != (image.height, image.width):
            resample = self.image_processor.resample  # None: the PIL processors' default
            image = image.resize((width, height), resample=Image.Resampling(
                Image.Resampling.BILINEAR if resample is None else resample))
        return np.asarray(image, dtype=np.uint8)

    def image_tokens(self, image: np.ndarray) -> int:
        """Placeholder tokens of a resized image: one per merged patch."""
        return image_token_count(image.shape[0], image.shape[1], self.patch_size,
                                 self.merge_size)


def no_images() -> tuple[np.ndarray, np.ndarray]:
    """`(pixels, image_sizes)` of a row without images."""
    return np.zeros(0, dtype=np.uint8), np.zeros((0, 2), dtype=np.int64)


def image_columns(arrays: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """A row's resized images as the two columns its Ray Data row stores: every image's RGB
    bytes one after another (`pixels [P]` uint8) and their `(height, width)` (`image_sizes
    [I, 2]` int64), `ImageInputs`' layout."""
    if not arrays:
        return no_images()
    return (np.concatenate([a.reshape(-1) for a in arrays]),
            np.array([a.shape[:2] for a in arrays], dtype=np.int64))


def has_image_processor(path: str | Path) -> bool:
    """Whether a target's tokenizer folder also holds an image processor (a vision-language
    target's); a text-only job checks two file names and nothing more."""
    folder = Path(path)
    if not folder.is_dir() or (folder / IMAGE_PROCESSOR_FILE).exists():
        return folder.is_dir()
    try:
        return "image_processor" in json.loads((folder / PROCESSOR_FILE).read_text())
    except (OSError, ValueError):
        return False


def load_vision_processor(path: str | Path, pixel_bounds: dict[str, Any] | None = None
                          ) -> VisionProcessor | None:
    """The target's processor, or None for a text-only target. Without the processor class
    (its video half needs torchvision), the image processor, tokenizer and the folder's chat
    template are loaded one by one. `pixel_bounds`: vLLM's `mm_processor_kwargs`, whose
    `min_pixels` / `max_pixels` the engine applies, so images are resized to what it takes."""
    if not has_image_processor(path):
        return None
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    try:
        processor = AutoProcessor.from_pretrained(path)
        if getattr(processor, "image_processor", None) is not None:
            return _bounded(VisionProcessor.from_processor(processor), pixel_bounds)
    except Exception as e:  # noqa: BLE001 -- any failure falls back to the parts
        logger.info("%s: AutoProcessor failed (%s); loading its parts", path, e)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return _bounded(VisionProcessor.from_parts(
        tokenizer, AutoImageProcessor.from_pretrained(path),
        _folder_chat_template(Path(path)) or tokenizer.chat_template), pixel_bounds)


def _bounded(vision: VisionProcessor, pixel_bounds: dict[str, Any] | None) -> VisionProcessor:
    size = vision.image_processor.size
    for key, edge in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
        if (pixel_bounds or {}).get(key) is not None:
            size[edge] = int(pixel_bounds[key])
    return vision


def image_root(paths: str | list[str] | None) -> str | None:
    """What relative image paths in the chats are relative to: the folder of `data.path` (a
    file's folder, or the folder itself); None (the workers' working directory) for a list."""
    if not isinstance(paths, str):
        return None
    return str(Path(paths) if Path(paths).is_dir() else Path(paths).parent)


def _folder_chat_template(folder: Path) -> str | None:
    if (folder / "chat_template.jinja").exists():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").exists():
        return json.loads((folder / "chat_template.json").read_text()).get("chat_template")
    return None


def tokenize_vision_conversation(vision: VisionProcessor, messages: list[dict[str, Any]],
                                 images: list) -> tuple[list[int], list[int], np.ndarray,
                                                        np.ndarray]:
    """`(ids, mask, pixels, image_sizes)` of a conversation and its decoded `images` (in item
    order): ids with every image expanded, mask 1 on the answer tokens only, the images resized
    (`image_columns`; see the module docstring). Raises `NoAssistantTurn`, or ValueError when
    the template's rendering and the images disagree or the turns cannot be located."""
    if not any(m["role"] == "assistant" for m in messages):
        raise NoAssistantTurn("the conversation has no assistant message")
    text, spans, end_token = _rendered_spans(vision, text_only(messages))
    if text.count(vision.image_token) != len(images):
        raise ValueError(f"the chat template writes {text.count(vision.image_token)} "
                         f"{vision.image_token} for {len(images)} image items")
    arrays = [vision.resized(image) for image in images]
    counts = [vision.image_tokens(array) for array in arrays]
    text, spans = expand_image_tokens(text, vision.image_token, counts, spans)
    encoded = vision.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    mask = mask_from_spans(encoded["offset_mapping"], spans, end_token=end_token)
    mask = [0 if token == vision.image_token_id else m for token, m in zip(ids, mask, strict=True)]
    if ids.count(vision.image_token_id) != sum(counts):
        raise ValueError(f"{ids.count(vision.image_token_id)} image tokens after tokenising, "
                         f"expected {sum(counts)}")
    return (ids, mask, *image_columns(arrays))


def image_prompt(vision: VisionProcessor, messages: list[dict[str, Any]],
                 root: str | Path | None = None) -> tuple[list[int], ImageInputs | None]:
    """A prompt for the target to answer: `messages` rendered with the generation prompt, every
    image loaded (paths relative to `root`), resized and expanded as in training rows."""
    text = vision.apply_chat_template(text_only(messages), tokenize=False,
                                      add_generation_prompt=True)
    arrays = [vision.resized(load_image(ref, root)) for ref in image_refs(messages)]
    if text.count(vision.image_token) != len(arrays):
        raise ValueError(f"the chat template writes {text.count(vision.image_token)} "
                         f"{vision.image_token} for {len(arrays)} image items")
    text, _ = expand_image_tokens(text, vision.image_token,
                                  [vision.image_tokens(a) for a in arrays], [])
    ids = vision.tokenizer(text, add_special_tokens=False)["input_ids"]
    return list(ids), ImageInputs.of_rows([arrays]) if arrays else None


def _rendered_spans(vision: VisionProcessor, messages: list[dict[str, Any]]
                    ) -> tuple[str, list[tuple[int, int]], bool]:
    """The template's text, its assistant spans, and whether the token after each span (the
    end-of-turn token) belongs to it: `{% generation %}` blocks say where turns are themselves."""
    if has_generation_markers(vision):
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, indices = render_jinja_template(
            [messages], chat_template=vision.chat_template, return_assistant_tokens_mask=True,
            **vision.tokenizer.special_tokens_map)
        return rendered[0], [tuple(span) for span in indices[0]], False
    text = vision.apply_chat_template(messages, tokenize=False)
    return text, assistant_spans(vision, messages, text), True


def expand_image_tokens(text: str, image_token: str, counts: Sequence[int],
                        spans: Sequence[tuple[int, int]]
                        ) -> tuple[str, list[tuple[int, int]]]:
    """`text` with its i-th `image_token` repeated `counts[i]` times (the processor's
    expansion), and `spans` moved to the same characters of the expanded text."""
    pieces = text.split(image_token)
    if len(pieces) != len(counts) + 1:
        raise ValueError(f"{len(pieces) - 1} {image_token} in the text for {len(counts)} images")
    starts, cursor = [], 0  # where each placeholder starts in `text`
    for piece in pieces[:-1]:
        cursor += len(piece)
        starts.append(cursor)
        cursor += len(image_token)

    def moved(position: int) -> int:
        return position + sum((n - 1) * len(image_token)
                              for start, n in zip(starts, counts, strict=True)
                              if start < position)

    expanded = pieces[0] + "".join(image_token * n + piece
                                   for n, piece in zip(counts, pieces[1:], strict=True))
    return expanded, [(moved(start), moved(end)) for start, end in spans]


def chat_source(config: JobConfig, output_dir: Path) -> str | list[str] | None:
    """`data.path`; for the vision-language kit's target without one, its generated image chats
    (`eagle_ray.tiny.vision`: written once into `output_dir`, the pictures beside them)."""
    if config.data.path is not None or not config.target.takes_images \
            or config.target.model_path is not None:
        return config.data.path
    from eagle_ray.tiny.vision import write_image_chat_dataset

    path = output_dir / "generated" / f"image-chats-{config.data.num_samples}.jsonl"
    if not path.exists():
        write_image_chat_dataset(path, config.data.num_samples, seed=0)
    return str(path)
