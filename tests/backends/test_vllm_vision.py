"""The vLLM backend on a vision-language target equals the HF reference.

One in-process vLLM engine for the module on a tiny Qwen2.5-VL (fp32, eager), where torchvision
cannot be imported (eagle_ray.backends.vllm.torchvision_shim): a micro-batch mixing rows with
one image, two images and none equals `HFEagle3TargetModel` on the same checkpoint on every slot
(aux states, last hidden, logits, shifted ids, masks, positions); a text-only micro-batch on the
same engine too; and other pixels change the states at and after the image.
"""

import logging
import types

import pytest
import torch
from transformers import AutoConfig, AutoImageProcessor
from vision_helpers import GRIDS, image_rows, padded, vllm_temporal_positions

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.backends.vllm import vision
from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
from eagle_ray.contract.images import ImageInputs
from eagle_ray.testing import random_micro_batch
from eagle_ray.tiny.vision import build_tiny_vl_target

from reference_checks import FP32_ATOL, assert_matches_reference

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    path = build_tiny_vl_target(tmp_path_factory.mktemp("vl") / "qwen2_5_vl", "qwen2_5_vl")
    # The kit saves its processor as one without a video processor; vLLM builds Qwen2.5-VL's,
    # which loads video settings (falling back to preprocessor_config.json, as published
    # Qwen2.5-VL checkpoints ship it).
    AutoImageProcessor.from_pretrained(path).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def targets(vl_path):
    """The vLLM target (in-process engine) and the HF reference on the same checkpoint."""
    target = VLLMEagle3TargetModel.from_pretrained(
        vl_path, dtype="float32",
        vllm_kwargs={"max_model_len": 256, "kv_cache_memory_bytes": 64 * 2**20,
                     "max_num_seqs": 8})
    logger.info("vision-language engine up in %.1fs", target.runner.start_seconds)
    yield target, HFEagle3TargetModel.from_pretrained(vl_path, dtype=torch.float32,
                                                      encoding="last_hidden")
    target.shutdown()


def _image_batch(path, seed: int):
    config = AutoConfig.from_pretrained(path)
    rows, images = image_rows(config, torch.Generator().manual_seed(seed))
    return config, rows, images, *padded(rows)


def _max_differences(batch, reference, head) -> dict[str, float]:
    valid = reference.attention_mask.bool()
    return {name: float((a - b)[valid].abs().max()) for name, a, b in (
        ("aux_hidden_states", batch.aux_hidden_states, reference.aux_hidden_states),
        ("last_hidden", batch.last_hidden, reference.last_hidden),
        ("logits", head(batch.last_hidden), head(reference.last_hidden)))}


def test_mixed_image_and_text_rows_equal_hf(targets, vl_path):
    target, reference = targets
    config, rows, images, ids, attention = _image_batch(vl_path, seed=1)
    assert [len(GRIDS[r]) for r in range(3)] == [1, 0, 2]  # one image, none, two
    batch = target.generate_batch(ids, attention, attention, images=images)
    expected = reference.generate_batch(ids, attention, attention, images=images)
    head = reference.get_target_head()
    logger.info("max |vLLM - HF| per field: %s", _max_differences(batch, expected, head))
    assert_matches_reference(batch, expected, head)
    assert torch.equal(batch.positions, expected.positions)
    merge = config.vision_config.spatial_merge_size
    for r, row in enumerate(rows):
        assert batch.positions[r, :len(row)].tolist() == vllm_temporal_positions(
            row, GRIDS[r], config.image_token_id, merge)


def test_text_only_micro_batch_on_the_same_engine_equals_hf(targets, vl_path):
    target, reference = targets
    ids, attention, loss = random_micro_batch(target.vocab_size, (17, 40, 5), seed=2)
    config = AutoConfig.from_pretrained(vl_path)
    vision_ids = {config.image_token_id, config.video_token_id, config.vision_start_token_id,
                  config.vision_end_token_id}
    text = torch.tensor([i for i in range(target.vocab_size) if i not in vision_ids])
    batch_args = (text[ids % len(text)], attention, loss)  # no vision token in any row
    batch = target.generate_batch(*batch_args)
    expected = reference.generate_batch(*batch_args)
    assert batch.positions is None and expected.positions is None
    assert_matches_reference(batch, expected, reference.get_target_head())


def test_other_pixels_change_the_states_at_and_after_the_image(targets, vl_path):
    """Control: the image really reaches the captured states (and only from the image on)."""
    target, _ = targets
    config, rows, images, ids, attention = _image_batch(vl_path, seed=3)
    other = ImageInputs(torch.randint(0, 256, images.pixels.shape, dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(4)),
                        images.image_sizes, images.images_per_row)
    a = target.generate_batch(ids, attention, images=images).aux_hidden_states
    b = target.generate_batch(ids, attention, images=other).aux_hidden_states
    first_image, n = rows[0].index(config.image_token_id), len(rows[0])
    torch.testing.assert_close(a[0, :first_image], b[0, :first_image], rtol=0, atol=FP32_ATOL)
    assert (a[0, first_image:n] - b[0, first_image:n]).abs().amax() > 1e-2
    torch.testing.assert_close(a[1], b[1], rtol=0, atol=FP32_ATOL)  # the text-only row


def test_engine_refuses_videos_and_images_its_processor_would_resize(targets, vl_path):
    target, _ = targets
    limits = target.runner.llm.llm_engine.model_config.multimodal_config.limit_per_prompt
    assert limits["video"].count == 0, limits
    with pytest.raises(ValueError, match="images only"):
        vision.vision_engine_kwargs({"limit_mm_per_prompt": {"image": 2, "video": 1}})
    config = AutoConfig.from_pretrained(vl_path)
    too_big = ImageInputs.of_rows([[torch.zeros(140, 140, 3, dtype=torch.uint8).numpy()]])
    ids, attention = padded([[5, config.vision_start_token_id]
                             + [config.image_token_id] * 25 + [config.vision_end_token_id, 6]])
    with pytest.raises(ValueError, match=r"image 0 is 140x140 but the target's processor "
                                         r"resizes it to 112x112"):
        target.generate_batch(ids, attention, images=too_big)


def test_an_expansion_that_differs_from_the_row_is_refused():
    """vLLM re-expands each image's collapsed placeholder; a count that differs from the row's
    fails loudly (else every state after the image would sit one place off)."""
    assert vision.collapse_placeholders([1, 9, 9, 9, 2, 9, 9, 3], [3, 2], 9) == [1, 9, 2, 9, 3]
    with pytest.raises(ValueError, match="contiguous run per image"):
        vision.collapse_placeholders([1, 9, 9, 2, 9, 3], [3], 9)
    row = torch.tensor([[1, 9, 9, 9, 2]])
    vision.check_expanded([types.SimpleNamespace(prompt_token_ids=[1, 9, 9, 9, 2])], row, [5])
    with pytest.raises(RuntimeError, match="expanded row 0's image placeholders to 4 tokens"):
        vision.check_expanded([types.SimpleNamespace(prompt_token_ids=[1, 9, 9, 2])], row, [5])
