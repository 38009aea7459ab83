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
