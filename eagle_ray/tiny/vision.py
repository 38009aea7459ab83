"""The built-in tiny vision-language targets and image-chat data (issue #54).

The counterpart of `eagle_ray.tiny` for targets that take images: a tiny Qwen2.5-VL (or Qwen3-VL)
with random weights, the kit's BPE tokenizer plus Qwen2-VL's vision tokens, a PIL image processor
(no torchvision needed), and a generated corpus of small pictures of shapes whose answers depend
on the picture ("Two red circles."), so a pre-trained target must look at the image. Nothing is
downloaded; everything is deterministic and cached under `cache_root()`.

The processor is saved as transformers' `PaddleOCRVLProcessor`: an image processor and a
tokenizer, expanding each `<|image_pad|>` into one token per merged patch exactly as Qwen2-VL's
processor does. Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's own processor classes also hold a video
processor, which transformers 5 cannot even construct without torchvision, so
`AutoProcessor.from_pretrained` of a checkpoint that names them fails on a torchvision-less
machine.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from eagle_ray.tiny import (
    KIT_TOKENIZER,
    build_tokenizer,
    cache_root,
    cached_checkpoint,
    generate_chat_samples,
    save_random_target,
)

if TYPE_CHECKING:
    from PIL.Image import Image as PILImage
    from transformers import PaddleOCRVLProcessor, PretrainedConfig, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

VL_KIT_VERSION = 2  # bump when anything below changes what gets built
KINDS = ("qwen2_5_vl", "qwen3_vl")
HIDDEN = 64  # text hidden size: one attention head of dim 64
NUM_LAYERS = 8  # EAGLE-3's default aux ids [1, N//2-1, N-4] need N >= 7
VISION_TOKENS = {"vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
                 "image_token": "<|image_pad|>", "video_token": "<|video_pad|>"}
# Qwen2-VL style: every image item becomes <|vision_start|><|image_pad|><|vision_end|> (the
# processor expands the pad); assistant turns sit inside {% generation %} as the text kit's do.
VL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>{% endgeneration %}\n"
    "{% else %}<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
VL_TOKENIZER = dataclasses.replace(KIT_TOKENIZER, chat_template=VL_CHAT_TEMPLATE)
# Vision patch size per kind (the real models'); 2x2 patches merge into one image token.
PATCH_SIZE = {"qwen2_5_vl": 14, "qwen3_vl": 16}
MERGE_SIZE = 2
GRID_CELLS = 3  # pictures are a 3x3 grid of cells, one image token each
IMAGE_SIZE = 84  # pixels; the processor resizes to 3x3 merged patches (84 or 96 pixels a side)

# Pre-training on the image-chat corpus (bump the version when any of these change).
PRETRAIN_VL_VERSION = 1
PRETRAIN_VL_STEPS = 200
PRETRAIN_VL_BATCH = 32
PRETRAIN_VL_CONVERSATIONS = 1500
PRETRAIN_VL_SEED = 1000
PRETRAIN_VL_LR = 5e-3

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220),
           "yellow": (230, 200, 20)}
_COUNT_WORDS = ("zero", "one", "two", "three")
_SLOT_WEIGHTS = (0.4, 0.25, 0.2, 0.15)
_DESCRIBE_QUESTIONS = ("What is in the picture?", "Describe the image.", "What do you see?")
_DESCRIBE_OPENERS = ("{N} {c} {s}", "I see {n} {c} {s}", "The picture shows {n} {c} {s}",
                     "There {are} {n} {c} {s}")
_DESCRIBE_ENDINGS = (".", " on a white background.", " in the picture.", ", nothing else.")
_COUNT_ANSWERS = ("There {are} {n}.", "{N}.", "I count {n}.", "I see {n} of them.")
_COLOUR_ANSWERS = ("{They} {are} {c}.", "{C}.", "The colour is {c}.", "All {c}.")


def tiny_vl_config(kind: str = "qwen2_5_vl", num_layers: int = NUM_LAYERS,
                   tokenizer: PreTrainedTokenizerFast | None = None) -> PretrainedConfig:
    """Config of a tiny Qwen2.5-VL- or Qwen3-VL-shaped target for `tokenizer`'s vocabulary and
    vision tokens (`build_vl_tokenizer()`'s by default): text hidden 64 (one head of dim 64, as
    vLLM's CPU kernels want), `num_layers` layers; a depth-2 vision tower of hidden 64 whose
    2x2-merged patches become image tokens. Small enough to pre-train in a minute or two."""
    from transformers import Qwen2_5_VLConfig, Qwen3VLConfig

    if kind not in KINDS:
        raise ValueError(f"unknown tiny vision-language kind {kind!r}; choose one of {KINDS}")
    tokenizer = tokenizer or build_vl_tokenizer()
    ids = vision_token_ids(tokenizer)
    text = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                num_hidden_layers=num_layers, num_attention_heads=HIDDEN // 64,
                num_key_value_heads=1, max_position_embeddings=1024,
                # Wider than the usual 0.02, as the text kit's, for peaked random predictions.
                initializer_range=0.08, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=False)
    vision = dict(depth=2, hidden_size=64, intermediate_size=128, num_heads=2,
                  out_hidden_size=HIDDEN, patch_size=PATCH_SIZE[kind],
                  spatial_merge_size=MERGE_SIZE, temporal_patch_size=2, initializer_range=0.08)
    special = dict(image_token_id=ids["image_token"], video_token_id=ids["video_token"],
                   vision_start_token_id=ids["vision_start_token"],
                   vision_end_token_id=ids["vision_end_token"], tie_word_embeddings=False)
    if kind == "qwen2_5_vl":
        # Qwen2.5-VL's [16, 24, 24] halved for head_dim 64 (the sections add up to head_dim / 2).
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e6,
                                   "mrope_section": [8, 12, 12]}
        vision.update(window_size=112, fullatt_block_indexes=[1], hidden_act="silu")
        return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **special)
    text.update(head_dim=64, rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                              "mrope_section": [12, 10, 10],
                                              "mrope_interleaved": True})
    vision.update(num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
    return Qwen3VLConfig(text_config=text, vision_config=vision, **special)


def build_vl_processor(kind: str = "qwen2_5_vl", seed: int = 0) -> PaddleOCRVLProcessor:
    """The processor of a tiny target of `kind`: `build_vl_tokenizer`'s tokenizer and Qwen2-VL's
    PIL image processor sized so a picture is 4 to 16 image tokens (see the module docstring for
    why the class is `PaddleOCRVLProcessor`)."""
    from transformers import PaddleOCRVLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    factor = PATCH_SIZE[kind] * MERGE_SIZE
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=(2 * factor) ** 2, max_pixels=(4 * factor) ** 2, patch_size=PATCH_SIZE[kind],
        merge_size=MERGE_SIZE, temporal_patch_size=2)
    return PaddleOCRVLProcessor(image_processor=image_processor,
                                tokenizer=build_vl_tokenizer(seed),
                                chat_template=VL_CHAT_TEMPLATE)


def build_vl_tokenizer(seed: int = 0) -> PreTrainedTokenizerFast:
    """The kit's BPE tokenizer (`eagle_ray.tiny.build_tokenizer`) with `VL_CHAT_TEMPLATE` and
    the four vision tokens appended as its last ids, as Qwen's follow its text vocabulary; named
    (`tokenizer.image_token`, `.image_token_id`) as the processor wants."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    base = build_tokenizer(seed=seed, spec=VL_TOKENIZER)
    backend = base.backend_tokenizer
    backend.add_special_tokens([AddedToken(token, special=True, normalized=False)
                                for token in VISION_TOKENS.values()])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=base.bos_token, eos_token=base.eos_token,
        pad_token=base.pad_token, chat_template=VL_CHAT_TEMPLATE,
        extra_special_tokens=dict(VISION_TOKENS))


def vision_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, int]:
    """`VISION_TOKENS`' names -> their ids in `tokenizer`."""
    return {name: tokenizer.convert_tokens_to_ids(token) for name, token in VISION_TOKENS.items()}


@dataclasses.dataclass(frozen=True)
class Picture:
    """What a generated picture shows: `count` shapes of one kind and colour."""

    shape: str
    colour: str
    count: int


def draw_picture(picture: Picture, rng: random.Random) -> PILImage:
    """An `IMAGE_SIZE`-pixel RGB picture of `picture` on white: each shape in its own cell of a
    3x3 grid (one image token each), its size and place jittered within the cell."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    cell = IMAGE_SIZE // GRID_CELLS
    fill = COLOURS[picture.colour]
    for index in rng.sample(range(GRID_CELLS**2), picture.count):
        size = rng.randint(cell * 3 // 4, cell - 2)
        left = (index % GRID_CELLS) * cell + rng.randint(1, cell - size - 1)
        top = (index // GRID_CELLS) * cell + rng.randint(1, cell - size - 1)
        box = (left, top, left + size, top + size)
        if picture.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif picture.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(left + size / 2, top), (left, top + size), (left + size, top + size)],
                         fill=fill)
    return image


def picture_answer(picture: Picture, question: int, pick: Callable[[tuple[str, ...]], str]
                   ) -> str:
    """The answer to question kind `question` (0 describe, 1 count, 2 colour) about `picture`,
    each phrasing slot drawn by `pick` (weighted as the text kit's corpus)."""
    many = picture.count > 1
    words = dict(n=_COUNT_WORDS[picture.count], N=_COUNT_WORDS[picture.count].capitalize(),
                 c=picture.colour, C=picture.colour.capitalize(), are="are" if many else "is",
                 They="They" if many else "It", s=picture.shape + ("s" if many else ""))
    if question == 0:
        return (pick(_DESCRIBE_OPENERS) + pick(_DESCRIBE_ENDINGS)).format(**words)
    return pick(_COUNT_ANSWERS if question == 1 else _COLOUR_ANSWERS).format(**words)


_QUESTIONS = (_DESCRIBE_QUESTIONS, ("How many shapes are in the picture?",),
              ("What colour are the shapes?",))


def _image_chats(num_samples: int, seed: int, text_fraction: float = 0.1
                 ) -> Iterator[tuple[list[dict], PILImage | None]]:
    """`(messages, picture image or None)` pairs: image chats with the PIL image in place of a
    path, and now and then a text-only chat of the text kit's corpus."""
    rng = random.Random(seed)
    texts = iter(generate_chat_samples(num_samples, seed=seed))

    def pick(options: tuple[str, ...]) -> str:
        return rng.choices(options, weights=_SLOT_WEIGHTS)[0]

    for _ in range(num_samples):
        if rng.random() < text_fraction:
            yield next(texts)["messages"], None
            continue
        picture = Picture(rng.choice(SHAPES), rng.choice(sorted(COLOURS)), rng.randint(1, 3))
        question = rng.choices(range(3), weights=(0.6, 0.2, 0.2))[0]
        image = draw_picture(picture, rng)
        answer = picture_answer(picture, question, pick)
        yield [{"role": "user", "content": [
                    {"type": "image", "image": image},
                    {"type": "text", "text": rng.choice(_QUESTIONS[question])}]},
               {"role": "assistant", "content": answer}], image


def generate_image_chats(num_samples: int, seed: int, image_dir: str | Path) -> list[dict]:
    """Deterministic image chats in the HF `messages` convention, the pictures written as PNGs
    into `image_dir` (referenced by absolute path); about one in ten is a text-only chat.

    The answers (what shapes, which colour, how many) are read off the picture, so a target
    that answers them right must look at it; their phrasing varies as the text kit's does."""
    image_dir = Path(image_dir).resolve()
    image_dir.mkdir(parents=True, exist_ok=True)
    samples = []
    for index, (messages, image) in enumerate(_image_chats(num_samples, seed)):
        if image is not None:
            path = image_dir / f"{seed}-{index:06d}.png"
            image.save(path)
            messages[0]["content"][0]["image"] = str(path)
        samples.append({"messages": messages})
    return samples


def write_image_chat_dataset(path: str | Path, num_samples: int = 256, seed: int = 0) -> Path:
    """Write `generate_image_chats` as JSONL with the PNGs in `<stem>-images/` beside it, each
    image path relative to the JSONL's folder (as `data.path`'s readers resolve them), so the
    folder can move."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    samples = generate_image_chats(num_samples, seed, path.parent / f"{path.stem}-images")
    root = path.parent.resolve()
    with open(path, "w") as f:
        for sample in samples:
            for item in _image_items(sample["messages"]):
                item["image"] = Path(item["image"]).relative_to(root).as_posix()
            f.write(json.dumps(sample) + "\n")
    return path


def _image_items(messages: list[dict]) -> list[dict]:
    return [item for m in messages if isinstance(m["content"], list) for item in m["content"]
            if item.get("type") == "image"]


def build_tiny_vl_target(path: str | Path, kind: str = "qwen2_5_vl", seed: int = 0) -> Path:
    """Build a tiny vision-language target (random fp32 weights, seeded) and its processor into
    `path`, loadable with `AutoModelForImageTextToText` and `AutoProcessor`."""
    from transformers import AutoModelForImageTextToText

    path = Path(path)
    processor = build_vl_processor(kind, seed)
    config = tiny_vl_config(kind, tokenizer=processor.tokenizer)
    # The image processor's own file too: vLLM builds Qwen2.5-VL's processor class, which
    # reads its settings from `preprocessor_config.json`, as published checkpoints ship it.
    return save_random_target(AutoModelForImageTextToText, config, path, seed, processor,
                              processor.image_processor)


def tiny_vl_target(kind: str = "qwen2_5_vl", pretrained: bool = False) -> Path:
    """Path of the cached tiny vision-language target of `kind` (built on first use).

    `pretrained=True`: after `pretrain_vl` on the image-chat corpus (a minute or two of CPU),
    so its greedy answers describe the picture it is shown."""
    name = kind + (f"-pretrained-v{PRETRAIN_VL_VERSION}" if pretrained else "")
    return cached_checkpoint(
        cache_root() / f"tiny-vl-v{VL_KIT_VERSION}" / name,
        lambda into: build_tiny_vl_target(into, kind), pretrain_vl if pretrained else None,
        f"tiny {kind} target" + (" (pre-training on image chats: a minute or two)"
                                 if pretrained else ""))


def encode_image_chat(processor: PaddleOCRVLProcessor, messages: list[dict]
                      ) -> dict[str, torch.Tensor]:
    """One conversation through the processor: `input_ids`, `attention_mask`, `mm_token_type_ids`
    and `assistant_masks` `[1, S]`, and `pixel_values` / `image_grid_thw` where it has images."""
    return dict(processor.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        return_tensors="pt"))


def collate_image_chats(rows: list[dict[str, torch.Tensor]], pad_token_id: int
                        ) -> dict[str, torch.Tensor]:
    """Right-padded model inputs of encoded rows, with `labels` on the answer tokens only.

    Keeps `mm_token_type_ids`: without it transformers' Qwen2.5-VL / Qwen3-VL quietly give every
    token 1-D positions instead of M-RoPE's (`compute_3d_position_ids` needs it to call
    `get_rope_index`), and the model would learn positions no other engine uses."""
    width = max(row["input_ids"].shape[1] for row in rows)
    batch = {name: torch.full((len(rows), width), fill, dtype=torch.long) for name, fill in
             (("input_ids", pad_token_id), ("attention_mask", 0), ("mm_token_type_ids", 0),
              ("labels", -100))}
    for r, row in enumerate(rows):
        n = row["input_ids"].shape[1]
        for name in ("input_ids", "attention_mask", "mm_token_type_ids"):
            batch[name][r, :n] = row[name][0]
        batch["labels"][r, :n] = row["input_ids"][0].masked_fill(row["assistant_masks"][0] == 0,
                                                                 -100)
    pictured = [row for row in rows if "pixel_values" in row]
    if pictured:
        batch["pixel_values"] = torch.cat([row["pixel_values"] for row in pictured])
        batch["image_grid_thw"] = torch.cat([row["image_grid_thw"] for row in pictured])
    return batch


def pretrain_vl(path: Path, steps: int = PRETRAIN_VL_STEPS, seed: int = 0) -> None:
    """Train the checkpoint at `path` in place, vision tower included, on the image-chat corpus
    (loss on the answer tokens), deterministically on the CPU: on one thread, so the result
    does not depend on the core count, and because threads of ops this small only wait on each
    other (on a busy 2-core machine a step took 20 s on two threads, under a second on one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _pretrain_vl(path, steps, seed)
    finally:
        torch.set_num_threads(threads)


def _pretrain_vl(path: Path, steps: int, seed: int) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.manual_seed(seed)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    rows = [encode_image_chat(processor, messages)
            for messages, _ in _image_chats(PRETRAIN_VL_CONVERSATIONS, PRETRAIN_VL_SEED)]
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_VL_LR, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=PRETRAIN_VL_LR,
                                                   total_steps=steps)
    model.train()
    for step in range(steps):
        picked = torch.randint(len(rows), (PRETRAIN_VL_BATCH,), generator=generator).tolist()
        batch = collate_image_chats([rows[i] for i in picked], processor.tokenizer.pad_token_id)
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 50 == 0 or step == steps - 1:
            logger.info("pre-training the tiny vision-language target: step %d/%d, loss %.3f",
                        step + 1, steps, float(loss.detach()))
    model.eval().save_pretrained(path)
