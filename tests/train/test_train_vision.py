"""The vision-language kit's job end to end (issue 54): examples/tiny-vl.yaml as shipped, on the
kit's generated image chats with one row's picture deleted. The job finishes, names that row's
image and why it was dropped, trains on every other row, and its draft beats an untrained one on
held-out image prompts by the margin the issue asks for -- measured on answers that depend on
the image (the kit target's answers change when the pictures are swapped: tests/test_tiny_vl.py).
"""

import json
from pathlib import Path

import pytest

from eagle_ray.config import JobConfig
from eagle_ray.config.loader import load_yaml
from eagle_ray.tiny.vision import write_image_chat_dataset
from eagle_ray.train.job import run_job

from pool_helpers import running_ray

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    data = write_image_chat_dataset(tmp_path_factory.mktemp("data") / "chats.jsonl", 320)
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    # A training row (past the 16 held out) whose picture is gone.
    missing_row = next(i for i, r in enumerate(rows) if i >= 16 and isinstance(
        r["messages"][0]["content"], list))
    picture = data.parent / rows[missing_row]["messages"][0]["content"][0]["image"]
    picture.unlink()
    output_dir = tmp_path_factory.mktemp("train")
    config = load_yaml(JobConfig, ROOT / "examples" / "tiny-vl.yaml", [
        f"data.path={data}", "target.name=vision-train-test", "target.namespace=eagle_ray_test",
        f"output_dir={output_dir}", "run_name=vision-train-test"])
    with running_ray(object_store_mb=400):
        summary = run_job(config)
    return summary, picture


def test_a_row_whose_image_is_missing_is_dropped_and_named_and_the_rest_train(trained):
    summary, picture = trained
    data = summary["data"]
    assert data["dropped_image_missing"] == 1
    assert data["kept"] == 320 - 16 - 1
    assert data["training_images"] > 200
    assert data["dropped_images"] == [f"image {picture}: no such file"]


def test_the_trained_draft_beats_an_untrained_one_on_image_prompts(trained):
    summary, _ = trained
    report = summary["eval"]
    assert report["images"] >= 8  # the held-out prompts hold pictures
    (row,) = [r for r in report["simulated"] if r["num_speculative_tokens"] == 3]
    assert row["trained"] >= row["untrained"] + 0.3, row
    assert row["acceptance_per_position_trained"][0] > 0.5


def test_vllm_serving_the_draft_beside_the_target_changes_no_greedy_answer(trained):
    # vLLM serves the exported draft beside the VLM (its images in multi_modal_data): its greedy
    # answers are the target's served alone, on every held-out image prompt.
    summary, _ = trained
    report = summary["eval"]
    (served,) = [r for r in report["vllm"] if r["num_speculative_tokens"] == 3]
    assert served["greedy_equal_fraction"] == 1.0, served
    assert served["failed"] == 0 and served["prompts"] == report["prompts"], served
    assert report["vllm_target_equals_pool_fraction"] == 1.0, report


def test_vllm_serves_the_draft_at_least_as_well_as_the_exact_simulation_says(trained):
    """vLLM's acceptance is not below the exact figure (a draft served on other inputs than it
    was trained on would fall). It is above it today (2.94 against 2.79 in a make-style run):
    vLLM counts drafts accepted past the stop token, and on some image prompts drafts as if at
    positions 0 .. S-1 -- issue 54, open; docs/contract.md, "Images"."""
    summary, _ = trained
    report = summary["eval"]
    (served,) = [r for r in report["vllm"] if r["num_speculative_tokens"] == 3]
    (simulated,) = [r for r in report["simulated"] if r["num_speculative_tokens"] == 3]
    assert served["mean_acceptance_length"] >= simulated["trained"] - 0.05, (served, simulated)
    assert served["mean_acceptance_length"] >= simulated["untrained"] + 0.3, (served, simulated)
