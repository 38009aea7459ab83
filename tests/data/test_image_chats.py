"""Image-text chats (issue #54): rendered with a vision-language target's own template and
processor, each image expanded into its placeholder tokens with the loss mask following the
expansion; images resized as the processor resizes them (its pixel values of the travelling
bytes equal those of the original); bad images dropped, counted and named while the other rows
train; Ray Data decodes the images on its workers and the micro-batches carry them as
`ImageInputs` (text micro-batches stay 3-tuples)."""

import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from eagle_ray.config import DataConfig
from eagle_ray.contract.images import (
    ImageInputs,
    ImageTokens,
    check_processor_sizes,
    validate_images,
)
from eagle_ray.data.chat import conversation_messages
from eagle_ray.data.draft_vocab import count_answers
from eagle_ray.data.images import VisionProcessor, load_image, load_vision_processor
from eagle_ray.data.ingest import read_chats, tokenized, training_rows
from eagle_ray.data.micro_batches import collate, token_budget_micro_batches
from eagle_ray.data.tokenize import (
    tokenize_chats,
    tokenize_image_row,
    tokenize_row,
)
from eagle_ray.tiny.vision import build_vl_processor
from eagle_ray.train.loop import epoch_micro_batches

from pool_helpers import running_ray

VOCAB = 4096


@pytest.fixture(scope="module")
def processor_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("vl-processor")
    build_vl_processor().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def vision(processor_dir):
    return load_vision_processor(processor_dir)


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    """Two PNGs of sizes the processor resizes, to different patch grids (a gradient, so a
    resize that differs from the processor's shows), and a file that is no image."""
    root = tmp_path_factory.mktemp("pictures")
    ramp = np.linspace(0, 255, 90 * 75 * 3).reshape(75, 90, 3).astype(np.uint8)
    Image.fromarray(ramp).save(root / "red.png")
    Image.fromarray(np.tile(ramp[:, :, ::-1], (1, 2, 1))).save(root / "wide.png")
    (root / "broken.png").write_bytes(b"not a png at all")
    return root


def chat(question, answer, *images, follow_up=None):
    """A user turn with `images` before the question and an answer (and a second turn)."""
    content = [*({"type": "image", "image": str(i)} for i in images),
               {"type": "text", "text": question}]
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
    if follow_up:
        messages += [{"role": "user", "content": follow_up[0]},
                     {"role": "assistant", "content": follow_up[1]}]
    return messages


def test_ids_mask_and_pixels_are_the_processors_own(vision, processor_dir, pictures):
    messages = chat("What is this?", "A red square.", pictures / "red.png",
                    follow_up=([{"type": "image", "image": str(pictures / "wide.png")},
                                {"type": "text", "text": "And this?"}], "Blue."))
    status, ids, mask, pixels, sizes = tokenize_image_row(
        vision, messages, 4096, VOCAB, "truncate", "test")
    from transformers import AutoProcessor

    own = AutoProcessor.from_pretrained(processor_dir).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
        return_tensors="np")
    assert status == "kept" and pixels.dtype == np.uint8 and sizes.dtype == np.int64
    assert ids == own["input_ids"][0].tolist() and mask == own["assistant_masks"][0].tolist()
    images = ImageInputs(torch.from_numpy(pixels), torch.from_numpy(sizes), torch.tensor([2]))
    assert sizes.tolist() == (own["image_grid_thw"][:, 1:] * vision.patch_size).tolist()
    assert sizes.tolist() != [[75, 90], [75, 180]], "both images were resized"
    check_processor_sizes(images, vision.image_processor)
    # What the engine's processor makes of the travelling bytes is what it makes of the files.
    travelled = vision.image_processor(images=images.arrays(), return_tensors="np")
    assert np.array_equal(travelled["pixel_values"], own["pixel_values"])
    # Each image is one placeholder per merged patch, and none of them carries loss.
    validate_images(images, torch.tensor([ids]), torch.ones(1, len(ids), dtype=torch.long),
                    ImageTokens(vision.image_token_id, vision.patch_size, vision.merge_size))
    placeholders = [i for i, t in enumerate(ids) if t == vision.image_token_id]
    assert not any(mask[i] for i in placeholders)
    answer = vision.tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert answer == "A red square.<|end|>Blue.<|end|>"


def test_template_without_generation_markers_masks_the_same_tokens(vision, pictures):
    """Stock Qwen-VL templates have no `{% generation %}`: the turns are located in the text and
    moved by the expansion of every image before them."""
    # (Jinja's trim_blocks drops the newline after `{% endgeneration %}`: so must this copy.)
    plain = VisionProcessor.from_parts(
        vision.tokenizer, vision.image_processor,
        vision.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}\n", ""))
    assert plain.chat_template != vision.chat_template
    messages = chat("Two?", "Yes, two.", pictures / "wide.png", pictures / "red.png",
                    follow_up=("Sure?", "Sure."))
    marked = tokenize_image_row(vision, messages, 4096, VOCAB, "truncate", "test")
    located = tokenize_image_row(plain, messages, 4096, VOCAB, "truncate", "test")
    assert located[1] == marked[1] and located[2] == marked[2]
    assert sum(located[2]) == len(vision.tokenizer("Yes, two.<|end|>Sure.<|end|>",
                                                   add_special_tokens=False)["input_ids"])


def test_bad_images_are_dropped_counted_and_named(vision, pictures, caplog):
    conversations = [
        ("ok", chat("What?", "Red.", pictures / "red.png")),
        ("missing", chat("What?", "Gone.", pictures / "nowhere.png")),
        ("broken", chat("What?", "Broken.", pictures / "broken.png")),
        ("text", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]),
        ("no-answer", chat("What?", "x", pictures / "red.png")[:1]),
    ]
    with caplog.at_level(logging.WARNING, logger="eagle_ray.data.tokenize"):
        chats = tokenize_chats(conversations, vision.tokenizer, 4096, VOCAB, vision=vision)
    assert chats.counts() == {"kept": 2, "truncated": 0, "dropped_too_long": 0,
                              "dropped_no_answer": 1, "dropped_unrenderable": 0,
                              "dropped_image_missing": 1, "dropped_image_unreadable": 1}
    assert f"missing: dropped (dropped_image_missing): image {pictures / 'nowhere.png'}" \
        in caplog.text
    assert f"broken: dropped (dropped_image_unreadable): image {pictures / 'broken.png'}" \
        in caplog.text
    (_, _, red_pixels, red_sizes), (_, text_mask, text_pixels, text_sizes) = chats.rows
    own = vision.image_processor(images=[Image.open(pictures / "red.png")], return_tensors="np")
    travelled = vision.image_processor(images=[red_pixels.reshape(*red_sizes[0], 3)],
                                       return_tensors="np")
    assert np.array_equal(travelled["pixel_values"], own["pixel_values"])
    # A text row in a vision job: no image bytes, no sizes.
    assert text_pixels.shape == (0,) and text_sizes.shape == (0, 2) and sum(text_mask) > 0


def test_a_row_is_never_cut_inside_an_image(vision, pictures):
    messages = chat("Describe it in detail, please, at length.", "Red.", pictures / "red.png",
                    follow_up=("And then?", "Nothing more."))
    full = tokenize_image_row(vision, messages, 4096, VOCAB, "truncate", "test")
    last = max(i for i, t in enumerate(full[1]) if t == vision.image_token_id)
    for max_length in (last - 3, last + 1):  # inside the image; right after it (no end marker)
        status, ids, *_ = tokenize_image_row(vision, messages, max_length, VOCAB, "truncate", "t")
        assert (status, ids) == ("dropped_image_overflow", [])
    first_answer = full[2].index(1)  # after the image: the cut keeps the image and an answer
    status, ids, mask, pixels, grid = tokenize_image_row(vision, messages, first_answer + 1,
                                                         VOCAB, "truncate", "t")
    assert status == "truncated" and ids == full[1][:len(ids)] and mask == full[2][:len(ids)]
    assert np.array_equal(pixels, full[3]) and np.array_equal(grid, full[4])
    # `overlong="drop"` drops every overlong row as before.
    assert tokenize_image_row(vision, messages, last + 1, VOCAB, "drop", "t")[0] == \
        "dropped_too_long"


def test_a_text_target_drops_image_rows_and_trains_the_rest(vision, pictures, caplog):
    text = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
            {"role": "assistant", "content": "Hello."}]
    with caplog.at_level(logging.WARNING, logger="eagle_ray.data.tokenize"):
        chats = tokenize_chats([("img", chat("What?", "Red.", pictures / "red.png")),
                                ("txt", text)], vision.tokenizer, 4096, VOCAB)
    assert chats.counts()["dropped_image_unsupported"] == 1 and chats.counts()["kept"] == 1
    assert f"img: dropped (dropped_image_unsupported): image {pictures / 'red.png'}" \
        in caplog.text
    # A text-items-only list renders as the plain string would.
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]
    assert chats.rows == [tuple(tokenize_row(vision.tokenizer, plain, 4096, VOCAB, "truncate",
                                             "t")[1:])]


def test_content_items_in_every_shape_readers_give(pictures):
    """Arrow gives every item every field (None where unset); OpenAI's image_url is an image."""
    messages = conversation_messages({"messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "Hi", "image": None},
            {"type": "image", "text": None, "image": str(pictures / "red.png")},
            {"type": "image_url", "image_url": {"url": "https://example.org/a.png"}}]},
        {"role": "assistant", "content": "Yo"}]}, "here")
    assert messages[0]["content"] == [
        {"type": "text", "text": "Hi"}, {"type": "image", "image": str(pictures / "red.png")},
        {"type": "image", "image": "https://example.org/a.png"}]
    data = (pictures / "red.png").read_bytes()
    assert np.array_equal(np.asarray(load_image({"bytes": data, "path": None})),
                          np.asarray(load_image("red.png", root=pictures)))


def test_collate_carries_images_and_text_batches_stay_three_tuples():
    text = ([5, 6, 7], [0, 1, 1])
    empty = ([5, 6], [0, 1], np.zeros(0, np.uint8), np.zeros((0, 2), np.int64))
    one = ([1, 9, 9, 2], [0, 0, 0, 1], np.full(2 * 4 * 3, 1, np.uint8), np.array([[2, 4]]))
    two = ([9, 9, 9], [0, 0, 1], np.arange(2 * 2 * 3 + 4 * 2 * 3, dtype=np.uint8),
           np.array([[2, 2], [4, 2]]))
    assert len(collate([text, text])) == 3 and len(collate([empty, text])) == 3
    ids, attention, loss, images = collate([text, one, empty, two])
    assert isinstance(images, ImageInputs) and ids.shape == (4, 4)
    assert images.images_per_row.tolist() == [0, 1, 0, 2]
    assert images.image_sizes.tolist() == [[2, 4], [2, 2], [4, 2]]
    assert torch.equal(images.pixels, torch.from_numpy(np.concatenate([one[2], two[2]])))
    assert torch.equal(images.select([3]).pixels, torch.from_numpy(two[2]))
    packed = list(token_budget_micro_batches([text, one, empty, two], 8, 2, window=4))
    assert sum(len(b[0]) for b in packed) == 4
    assert sum(int(b[3].images_per_row.sum()) for b in packed if len(b) == 4) == 3
    assert all(len(b) == 3 for b in token_budget_micro_batches([text] * 5, 8, 2))


@pytest.fixture(scope="module")
def local_ray():
    with running_ray(num_cpus=2):
        yield


@pytest.mark.slow
def test_ray_data_decodes_images_on_workers_and_batches_carry_them(
        vision, processor_dir, pictures, tmp_path, local_ray):
    """JSONL (string and list content mixed; a relative path) and Parquet (Arrow structs)."""
    rows = [chat("What?", "Red.", "red.png"), chat("What?", "Wide.", pictures / "wide.png"),
            chat("What?", "Gone.", pictures / "nowhere.png"),
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n"
                                                  for m in rows))
    # Parquet columns have one type: every content a list (the answer's a list of text items).
    both = chat("Two?", "Both.", pictures / "red.png", pictures / "wide.png")
    both[1]["content"] = [{"type": "text", "text": "Both."}]
    pq.write_table(pa.Table.from_pylist([{"messages": both}]), tmp_path / "more.parquet")
    source = read_chats([str(tmp_path / "chats.jsonl"), str(tmp_path / "more.parquet")], 0, 0.25)
    rows = tokenized(source, str(processor_dir), 4096, VOCAB, "truncate", 0.25,
                     image_root=str(pictures)).materialize()
    counts, statuses, tokens, dropped = count_answers(rows, [], VOCAB, images=True)
    assert {s: statuses[s] for s in ("kept", "dropped_image_missing", "training_images")} == \
        {"kept": 4, "dropped_image_missing": 1, "training_images": 4}
    assert dropped == [f"image {pictures / 'nowhere.png'}: no such file"]  # named, with why
    train = training_rows(rows, [])
    config = DataConfig(max_tokens_per_micro_batch=4096, micro_batch_size=8, shuffle_window=8)
    [batch] = list(epoch_micro_batches(train, config, pad_id=0, seed=0))
    ids, attention, loss, images = batch
    validate_images(images, ids, attention,
                    ImageTokens(vision.image_token_id, vision.patch_size, vision.merge_size))
    check_processor_sizes(images, vision.image_processor)
    assert sorted(images.images_per_row.tolist()) == [0, 1, 1, 2]
    own = vision.image_processor(images=[Image.open(pictures / "wide.png")], return_tensors="np")
    singles = [images.select([r]).arrays()[0] for r in range(4) if images.images_per_row[r] == 1]
    assert any(np.array_equal(vision.image_processor(images=[s], return_tensors="np")
                              ["pixel_values"], own["pixel_values"]) for s in singles)
    assert int(loss.sum()) == int(counts.sum())


def test_vllms_pixel_bounds_resize_images_as_the_engine_will(processor_dir, pictures):
    """`target.vllm_kwargs.mm_processor_kwargs` bounds what vLLM's processor resizes to; the
    pipeline resizes within the same bounds, so vLLM resizes nothing again (control: without
    them, the checkpoint's bounds give a larger image)."""
    image = Image.open(pictures / "wide.png")
    unbounded = load_vision_processor(processor_dir).resized(image)
    bound = 56 * 56
    bounded = load_vision_processor(processor_dir, {"max_pixels": bound}).resized(image)
    assert bounded.shape[0] * bounded.shape[1] <= bound < unbounded.shape[0] * unbounded.shape[1]
