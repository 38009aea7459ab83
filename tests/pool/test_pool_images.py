"""Image micro-batches through the pool (issue 54): a real Ray cluster, one replica of the HF
backend on a tiny Qwen2.5-VL-shaped target. Images travel beside the token ids through the
object store, micro-batches with and without images merge into one engine call, their
supervision (M-RoPE positions included) equals the backend called in this process, and a
micro-batch whose images do not match its placeholders fails alone."""

import pytest
import ray
import torch
from transformers import AutoConfig
from vision_helpers import image_rows, padded

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.pool import PoolClient, PoolConfig, TargetPool
from eagle_ray.pool.transport import batch_from_numpy, pack_inputs
from eagle_ray.tiny.vision import build_tiny_vl_target

from pool_helpers import TIMEOUT_S, replica_handle, running_ray

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory):
    return build_tiny_vl_target(tmp_path_factory.mktemp("tiny-vl") / "target", "qwen2_5_vl")


@pytest.fixture(scope="module")
def pool(vl_path):
    with running_ray(num_cpus=4, namespace="eagle_ray_test"):
        pool = TargetPool.create(PoolConfig(
            model_path=str(vl_path), backend="hf", dtype="float32", name="images",
            namespace="eagle_ray_test", replicas=1, cpus_per_bundle=0.5))
        try:
            yield pool
        finally:
            pool.shutdown()


@pytest.fixture(scope="module")
def local(vl_path):
    return HFEagle3TargetModel.from_pretrained(vl_path, dtype=torch.float32)


def image_micro_batch(config, seed: int):
    rows, images = image_rows(config, torch.Generator().manual_seed(seed))
    ids, attention = padded(rows)
    return ids, attention, attention.clone(), images


def arrays(micro_batch):
    ids, attention, loss, *images = micro_batch
    extra = () if not images else (images[0].pixels, images[0].image_sizes,
                                   images[0].images_per_row)
    return pack_inputs(ids, attention, loss, *extra)


def assert_same(batch, expected):
    assert batch.tensors().keys() == expected.tensors().keys()
    for name, tensor in expected.tensors().items():
        torch.testing.assert_close(batch.tensors()[name], tensor, atol=2e-5, rtol=1e-4,
                                   msg=name)


def test_image_and_text_micro_batches_merge_and_a_mismatched_one_fails_alone(pool, local,
                                                                            vl_path):
    config = AutoConfig.from_pretrained(vl_path)
    with_images = image_micro_batch(config, 1)
    text_only = tuple(t[1:2] for t in with_images[:3])  # the row without images
    mismatched = (*with_images[:3], with_images[3].select([2, 1, 0]))  # images on other rows
    replica = replica_handle(pool, 0)
    before = ray.get(replica.ready.remote(), timeout=TIMEOUT_S).engine
    answers = ray.get(replica.generate_many.remote(
        [1, 2, 3], *map(arrays, (with_images, text_only, mismatched))), timeout=TIMEOUT_S)
    after = ray.get(replica.ready.remote(), timeout=TIMEOUT_S).engine
    assert (after.engine_calls - before.engine_calls,
            after.merged_calls - before.merged_calls) == (1, 1)
    assert isinstance(answers[2], ValueError) and "image placeholder tokens" in str(answers[2])
    assert_same(batch_from_numpy(answers[0]),
                local.generate_batch(*with_images[:3], images=with_images[3]))
    # Merged with an image micro-batch, a text-only one comes back with positions too: its
    # rows' own 0 .. n-1, what the draft assumes without them.
    alone = batch_from_numpy(answers[1])
    real = text_only[1].bool()
    assert alone.positions[real].tolist() == list(range(int(real.sum())))
    assert_same(alone.with_tensors(**{k: v for k, v in alone.tensors().items()
                                      if k != "positions"}), local.generate_batch(*text_only))


def test_a_client_streams_image_micro_batches(pool, local, vl_path):
    config = AutoConfig.from_pretrained(vl_path)
    micro_batches = [image_micro_batch(config, seed) for seed in (2, 3)]
    client = PoolClient.connect(pool.config.name, "eagle_ray_test")
    results = list(client.stream(micro_batches))
    for micro_batch, batch in zip(micro_batches, results, strict=True):
        expected = local.generate_batch(*micro_batch[:3], images=micro_batch[3])
        assert_same(batch, expected)
        assert batch.positions.max() < micro_batch[1].sum(dim=1).max() - 1  # M-RoPE, not 0..S
