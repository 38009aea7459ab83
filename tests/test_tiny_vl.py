"""`eagle_ray.tiny.vision`: the tiny vision-language targets load with transformers' Auto classes
(processor included, without torchvision), their processor expands each image into one
placeholder per merged patch and masks the answers, the corpus's answers are read off its
pictures, and the pre-trained target's greedy answers follow the image it is shown."""

import json
import random

import pytest
import torch
from PIL import Image
from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

from eagle_ray.contract.aux_layers import default_eagle3_aux_layer_ids
from eagle_ray.data.chat import has_generation_markers, stop_token_ids
from eagle_ray.tiny.vision import (
    COLOURS,
    KINDS,
    VISION_TOKENS,
    Picture,
    build_tiny_vl_target,
    collate_image_chats,
    draw_picture,
    encode_image_chat,
    generate_image_chats,
    tiny_vl_target,
    write_image_chat_dataset,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Ops this small run faster on one thread, and much faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=KINDS)
def target(request, tmp_path_factory):
    return build_tiny_vl_target(tmp_path_factory.mktemp(request.param) / "target", request.param)


def chat(image, question="What is in the picture?", answer=None) -> list[dict]:
    messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                             {"type": "text", "text": question}]}]
    return messages + ([{"role": "assistant", "content": answer}] if answer else [])


def test_processor_loads_with_auto_processor_and_expands_each_image(target):
    processor = AutoProcessor.from_pretrained(target)
    tokenizer = processor.tokenizer
    assert type(processor).__name__ == "PaddleOCRVLProcessor"
    assert type(processor.image_processor).__name__.startswith("Qwen2VLImageProcessor")
    config = AutoConfig.from_pretrained(target)
    assert [tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS.values()] == [
        config.vision_start_token_id, config.vision_end_token_id, config.image_token_id,
        config.video_token_id]
    assert max(config.image_token_id, config.video_token_id) < config.text_config.vocab_size
    merge = config.vision_config.spatial_merge_size
    images = [Image.new("RGB", size, "red") for size in ((84, 84), (140, 60), (400, 300))]
    messages = [{"role": "user", "content": [
        *({"type": "image", "image": image} for image in images),
        {"type": "text", "text": "What is in the picture?"}]},
        {"role": "assistant", "content": "Two red circles."}]
    encoded = encode_image_chat(processor, messages)
    ids, grid = encoded["input_ids"][0], encoded["image_grid_thw"]
    tokens = (grid.prod(dim=1) // merge**2).tolist()
    assert all(4 <= n <= 16 for n in tokens) and len(set(tokens)) > 1
    assert int((ids == config.image_token_id).sum()) == sum(tokens)
    assert int((ids == config.vision_start_token_id).sum()) == len(images)
    assert encoded["pixel_values"].shape[0] == int(grid.prod(dim=1).sum())
    # The mask covers the answer and its end-of-turn token, nothing of the prompt or images.
    masked = ids[encoded["assistant_masks"][0] == 1]
    assert tokenizer.decode(masked) == "Two red circles.<|end|>"
    assert has_generation_markers(tokenizer)
    assert tokenizer.convert_ids_to_tokens(list(stop_token_ids(tokenizer))) == ["<|end|>",
                                                                              "<|eos|>"]


def test_model_loads_and_runs_on_images(target):
    model = AutoModelForImageTextToText.from_pretrained(target, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(target)
    config = model.config
    assert type(model).__name__ in ("Qwen2_5_VLForConditionalGeneration",
                                    "Qwen3VLForConditionalGeneration")
    assert default_eagle3_aux_layer_ids(config.text_config.num_hidden_layers) == [1, 3, 4]
    rng = random.Random(0)
    pictures = [draw_picture(Picture("circle", "red", 2), rng),
                draw_picture(Picture("square", "blue", 3), rng)]
    rows = [encode_image_chat(processor, chat(p, answer="Two red circles.")) for p in pictures]
    batch = collate_image_chats(rows, processor.tokenizer.pad_token_id)
    with torch.no_grad():
        out = model(**batch, output_hidden_states=True)
    assert out.logits.shape == (*batch["input_ids"].shape, config.text_config.vocab_size)
    assert len(out.hidden_states) == config.text_config.num_hidden_layers + 1
    assert torch.isfinite(out.loss)
    # The rows differ only in their picture: the vision tower's features reach the answer.
    assert torch.equal(batch["input_ids"][0], batch["input_ids"][1])
    answer = batch["labels"][0] != -100
    assert not torch.allclose(out.logits[0, answer], out.logits[1, answer], atol=1e-4)


def test_image_chats_are_deterministic_and_read_off_the_picture(tmp_path):
    first = generate_image_chats(40, seed=3, image_dir=tmp_path / "a")
    again = generate_image_chats(40, seed=3, image_dir=tmp_path / "b")
    pictured = [s for s in first if isinstance(s["messages"][0]["content"], list)]
    assert 30 <= len(pictured) < 40  # a few text-only chats too
    for one, two in zip(first, again, strict=True):
        if one in pictured:
            a, b = one["messages"][0]["content"][0]["image"], two["messages"][0]["content"][0][
                "image"]
            assert Image.open(a).tobytes() == Image.open(b).tobytes()
            assert Image.open(a).size == (84, 84)
            one["messages"][0]["content"][0]["image"] = b
        assert one == two
    # Describing and colour answers name the picture's colour (its most common non-white pixel).
    for sample in pictured:
        user, answer = sample["messages"][0]["content"], sample["messages"][1]["content"]
        if user[1]["text"].startswith("How many"):
            continue
        pixels = sorted(Image.open(user[0]["image"]).getcolors())
        colour = next(c for _, c in reversed(pixels) if c != (255, 255, 255))
        assert [name for name, rgb in COLOURS.items() if rgb == colour][0] in answer.lower()


def test_written_dataset_is_jsonl_with_relative_pngs(tmp_path):
    path = write_image_chat_dataset(tmp_path / "data" / "chats.jsonl", num_samples=12, seed=1)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 12
    images = [item["image"] for sample in lines for m in sample["messages"]
              if isinstance(m["content"], list) for item in m["content"]
              if item["type"] == "image"]
    assert images and all(not image.startswith("/") for image in images)
    assert all((path.parent / image).is_file() for image in images)


@pytest.mark.slow
def test_pretrained_target_answers_depend_on_the_image():
    """The acceptance criterion of the kit: greedy answers to held-out pictures name what the
    picture shows, and change when the pictures are swapped between the prompts."""
    path = tiny_vl_target("qwen2_5_vl", pretrained=True)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    stop = list(stop_token_ids(processor.tokenizer))
    rng = random.Random(12345)
    pictures = [Picture("circle", "red", 2), Picture("square", "blue", 1),
                Picture("triangle", "green", 3), Picture("square", "yellow", 2),
                Picture("circle", "blue", 3), Picture("triangle", "red", 1)]
    images = [draw_picture(p, rng) for p in pictures]
    questions = ["What is in the picture?", "Describe the image.", "What do you see?"] * 2

    def answers(order: list[int]) -> list[str]:
        out = []
        for question, i in zip(questions, order, strict=True):
            encoded = processor.apply_chat_template(
                chat(images[i], question), add_generation_prompt=True, tokenize=True,
                return_dict=True, return_tensors="pt")
            with torch.no_grad():
                ids = model.generate(**encoded, max_new_tokens=24, do_sample=False,
                                     eos_token_id=stop, pad_token_id=stop[-1])
            out.append(processor.tokenizer.decode(ids[0, encoded["input_ids"].shape[1]:],
                                                  skip_special_tokens=True))
        return out

    own = answers(list(range(len(images))))
    right = [all(word in answer.lower() for word in
                 (p.colour, p.shape, ("one", "two", "three")[p.count - 1]))
             for p, answer in zip(pictures, own, strict=True)]
    assert sum(right) >= len(pictures) - 1, list(zip(pictures, own, strict=True))
    swapped = answers([(i + 1) % len(images) for i in range(len(images))])
    changed = [a != b for a, b in zip(own, swapped, strict=True)]
    assert sum(changed) >= len(images) - 1, list(zip(own, swapped, strict=True))
