"""The pool with a real vLLM (CPU) replica returns what the backend returns when called directly.

The replica runs tensor parallelism (TP = 2) the way a GPU pool does: it holds both ranks'
resources in its placement group and vLLM runs the ranks as its own worker processes."""

import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from ray.exceptions import RayTaskError

from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
from eagle_ray.pool import PoolConfig, TargetPool
from eagle_ray.pool.engine_queue import merge_micro_batches, split_batch
from eagle_ray.testing import random_micro_batch

from fuzz_inputs import as_replica_inputs, hostile_micro_batches, valid_at_a_replica
from process_tree import descendants
from reference_checks import assert_matches_reference

pytestmark = pytest.mark.slow
TP = 2


@pytest.fixture(scope="module")
def vllm_pool(llama_path):
    ray.init(num_cpus=4, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_test")
    pool = TargetPool.create(PoolConfig(model_path=str(llama_path), backend="vllm",
                                        dtype="float32", name="vllm-pool", tp_size=TP,
                                        namespace="eagle_ray_test"))
    yield pool
    pool.shutdown()
    ray.shutdown()


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_hostile_input_at_the_client_and_at_a_replica_is_refused_iff_invalid(vllm_pool, data):
    served = vllm_pool.identity()
    hostile = data.draw(hostile_micro_batches(served.vocab_size, served.max_length))
    client = vllm_pool.client()
    try:
        client.submit(*hostile.batch)
    except (TypeError, ValueError) as e:
        assert not hostile.valid and hostile.explains(e), (hostile.mutations, e)
        assert client.stats.submitted == 0, "refused before it travels"
    else:
        assert hostile.valid, f"the client sent an invalid batch ({hostile.mutations})"
        client.next_result()  # an input the fuzzer left valid is served
    # A caller that bypasses the client: the replica itself never serves an invalid batch.
    replica = ray.get_actor(vllm_pool.config.replica_name(0), namespace="eagle_ray_test")
    try:
        ray.get(replica.generate.remote(0, as_replica_inputs(hostile.batch)), timeout=120)
    except RayTaskError as e:
        assert isinstance(e.as_instanceof_cause(), TypeError | ValueError), e
        assert not valid_at_a_replica(hostile), f"a valid batch was refused: {e}"
    else:
        assert valid_at_a_replica(hostile), f"a replica served {hostile.mutations}"


def test_pool_output_equals_the_backend_called_directly_bitwise(vllm_pool, llama_path, hf_llama):
    """The TP = 2 replica gives exactly what the same engine gives in this process, and within
    fp32 precision what a TP = 1 engine and the HF reference give. Also: after the hostile input
    above, the engine serves exactly as before and never restarted."""
    batches = [random_micro_batch(530, lengths, seed=i)
               for i, lengths in enumerate([(17, 9, 30, 4), (64,), (5, 40, 12)])]
    client = vllm_pool.client()
    through_pool = list(client.stream(batches))
    replica = ray.get_actor(vllm_pool.config.replica_name(0), namespace="eagle_ray_test")
    info = ray.get(replica.ready.remote())
    # The topology: one bundle with both ranks' resources, and vLLM's TP workers are the
    # replica's own child processes (not Ray actors elsewhere).
    (group,) = [g for g in ray.util.placement_group_table().values()
                if g["name"] == vllm_pool.config.placement_group_name(0)]
    assert list(group["bundles"].values()) == [{"CPU": float(TP)}]
    workers = sorted(p.name() for p in descendants(info.pid) if p.name().startswith("VLLM::Worker"))
    assert workers == [f"VLLM::Worker_TP{rank}" for rank in range(TP)]
    direct = VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="float32", tp_size=TP)
    try:
        # The replica may merge micro-batches that wait together into one engine call: merged
        # or alone, vLLM gives every row the same bits.
        merged = split_batch(direct.generate_batch(*merge_micro_batches(batches)), batches)
        for inputs, pooled, from_merged in zip(batches, through_pool, merged, strict=True):
            expected = direct.generate_batch(*inputs)
            assert pooled.encoding == expected.encoding == "last_hidden"
            for name, tensor in expected.tensors().items():
                assert torch.equal(pooled.tensors()[name], tensor), name
                assert torch.equal(from_merged.tensors()[name], tensor), name
    finally:
        direct.shutdown()
    single = VLLMEagle3TargetModel.from_pretrained(llama_path, dtype="float32")  # TP = 1
    try:
        for inputs, pooled in zip(batches, through_pool, strict=True):
            for reference in (single.generate_batch(*inputs), hf_llama.generate_batch(*inputs)):
                assert_matches_reference(pooled, reference, hf_llama.get_target_head())
    finally:
        single.shutdown()
    status = vllm_pool.status()["replicas"]["vllm-pool-replica-0"]
    assert status["served_micro_batches"] >= len(batches) and status["restarts"] == 0
