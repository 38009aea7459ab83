"""The HF backend on vision-language targets (Qwen2.5-VL and Qwen3-VL shapes): mixed image and
text rows in one micro-batch equal an independent forward of each row alone, on every slot;
the positions it reports are the temporal M-RoPE index vLLM computes; a text-only micro-batch
never runs the vision tower."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from vision_helpers import (
    GRIDS,
    KINDS,
    image_rows,
    padded,
    tiny_vl_model,
    vllm_temporal_positions,
)

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.contract.images import ImageInputs


@pytest.fixture(scope="module", params=KINDS)
def vl_model(request):
    return tiny_vl_model(request.param)



def _reference(model, ids: list[int], images: ImageInputs | None, layers: list[int]):
    """One row alone through the full model's own forward, its images through Qwen2-VL's PIL
    image processor: the stream entering layer k + 1 (the layer's output plus, in Qwen3-VL's
    first layers, its deepstack features) and the logits."""
    config = model.config
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images is not None:
        vision = config.vision_config
        processor = Qwen2VLImageProcessorPil(
            patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
            temporal_patch_size=vision.temporal_patch_size, min_pixels=1, max_pixels=2**30)
        features = processor(images=images.arrays(), return_tensors="pt")
        kwargs = {"pixel_values": features["pixel_values"],
                  "image_grid_thw": features["image_grid_thw"],
                  "mm_token_type_ids": (input_ids == config.image_token_id).int()}
    with torch.no_grad():
        out = model(input_ids=input_ids, output_hidden_states=True, **kwargs)
        deepstack = []
        if images is not None and hasattr(config.vision_config, "deepstack_visual_indexes"):
            features = model.model.get_image_features(kwargs["pixel_values"],
                                                      kwargs["image_grid_thw"])
            deepstack = [torch.cat(f) for f in features.deepstack_features]
    visual = input_ids[0] == config.image_token_id
    aux = []
    for k in layers:
        state = out.hidden_states[k + 1][0].clone()
        if k < len(deepstack):
            state[visual] += deepstack[k]
        aux.append(state)
    return torch.cat(aux, dim=-1), out.logits[0]


def test_mixed_image_and_text_rows_equal_each_row_alone(vl_model):
    generator = torch.Generator().manual_seed(1)
    rows, images = image_rows(vl_model.config, generator)
    ids, attention = padded(rows)
    backend = HFEagle3TargetModel(vl_model, encoding="logits")
    batch = backend.generate_batch(ids, attention, attention, images=images)
    merge = vl_model.config.vision_config.spatial_merge_size
    for r, row in enumerate(rows):
        n = len(row)
        alone = images.select([r]) if GRIDS[r] else None
        aux, logits = _reference(vl_model, row, alone, backend.aux_layer_ids)
        torch.testing.assert_close(batch.aux_hidden_states[r, :n], aux, atol=2e-5, rtol=1e-4)
        # slot t holds the distribution at t + 1 (docs/contract.md, "Shift")
        torch.testing.assert_close(batch.logits[r, :n - 1], logits[1:n], atol=2e-5, rtol=1e-4)
        assert batch.input_ids[r, :n - 1].tolist() == row[1:]
        expected = vllm_temporal_positions(row, GRIDS[r], vl_model.config.image_token_id, merge)
        assert batch.positions[r, :n].tolist() == expected
        assert not batch.positions[r, n:].any()


def test_image_features_reach_the_supervision(vl_model):
    """Control: other pixels change the states at and after the image, not before it."""
    generator = torch.Generator().manual_seed(2)
    rows, images = image_rows(vl_model.config, generator)
    ids, attention = padded(rows)
    backend = HFEagle3TargetModel(vl_model)
    other = ImageInputs(torch.randint(0, 256, images.pixels.shape, generator=generator,
                                      dtype=torch.uint8), images.image_sizes,
                        images.images_per_row)
    a = backend.generate_batch(ids, attention, images=images).aux_hidden_states
    b = backend.generate_batch(ids, attention, images=other).aux_hidden_states
    first_image = rows[0].index(vl_model.config.image_token_id)
    torch.testing.assert_close(a[0, :first_image], b[0, :first_image])
    assert (a[0, first_image:len(rows[0])] - b[0, first_image:len(rows[0])]).abs().amax() > 1e-3
    torch.testing.assert_close(a[1], b[1])  # the text-only row sees no image


def test_text_only_micro_batch_skips_the_vision_tower(vl_model):
    generator = torch.Generator().manual_seed(3)
    rows, images = image_rows(vl_model.config, generator)
    ids, attention = padded([rows[1]])
    calls = []
    handle = vl_model.model.visual.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        batch = HFEagle3TargetModel(vl_model).generate_batch(ids, attention)
    finally:
        handle.remove()
    assert calls == [] and batch.positions is None  # the draft's default positions 0 .. S-1
    aux, _ = _reference(vl_model, rows[1], None, HFEagle3TargetModel(vl_model).aux_layer_ids)
    torch.testing.assert_close(batch.aux_hidden_states[0], aux, atol=2e-5, rtol=1e-4)


def test_images_that_do_not_match_the_placeholders_are_refused(vl_model):
    generator = torch.Generator().manual_seed(4)
    rows, images = image_rows(vl_model.config, generator)
    ids, attention = padded(rows)
    backend = HFEagle3TargetModel(vl_model)
    with pytest.raises(ValueError, match="row 0 holds 4 image placeholder tokens"):
        backend.generate_batch(ids, attention, images=images.select([1, 0, 2]))
    with pytest.raises(ValueError, match="need"):
        backend.generate_batch(ids, attention)  # placeholders without their images


def test_images_not_at_the_processors_size_are_refused(vl_model):
    """An image the engine's processor would resize again is refused before the engine runs,
    naming its size and the one to send."""
    generator = torch.Generator().manual_seed(6)
    rows, images = image_rows(vl_model.config, generator)
    ids, attention = padded(rows)
    backend = HFEagle3TargetModel(vl_model)
    backend.runner.image_processor.size["longest_edge"] = 64 * 64  # a bound the images exceed
    with pytest.raises(ValueError, match=r"image 1 is \d+x\d+ but the target's processor "
                                         r"resizes it to"):
        backend.generate_batch(ids, attention, images=images)
