"""The pool with a real vLLM (CPU) replica returns what the backend returns when called directly."""

import pytest
import ray
import torch

from eagle_ray.pool import PoolConfig, TargetPool
from eagle_ray.testing import random_micro_batch
from eagle_ray.vllm_target import VLLMEagle3TargetModel

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vllm_pool(llama_path):
    ray.init(num_cpus=4, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_test")
    pool = TargetPool.create(PoolConfig(model_path=str(llama_path), backend="vllm",
                                        dtype="float32", name="vllm-pool",
                                        namespace="eagle_ray_test"))
    yield pool
    pool.shutdown()
    ray.shutdown()


def test_pool_output_equals_the_backend_called_directly_bitwise(vllm_pool, llama_path):
    batches = [random_micro_batch(530, lengths, seed=i)
               for i, lengths in enumerate([(17, 9, 30, 4), (64,), (5, 40, 12)])]
    client = vllm_pool.client()
    through_pool = list(client.stream(batches))
    direct = VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="float32",
                                                   multiprocess=True)
    try:
        for inputs, pooled in zip(batches, through_pool, strict=True):
            expected = direct.generate_batch(*inputs)
            assert pooled.encoding == expected.encoding == "last_hidden"
            for name, tensor in expected.tensors().items():
                assert torch.equal(pooled.tensors()[name], tensor), name
    finally:
        direct.shutdown()
    served = vllm_pool.status()["replicas"]["vllm-pool-replica-0"]["served_micro_batches"]
    assert served >= len(batches)
