"""A pool whose replicas cannot build their target says why at once: the engine's own message
and the config key to change, within seconds, with the pool removed and nothing restarted.
Each failure class runs on the real CPU vLLM engine (or fails before it, where it should)."""

import json
import shutil
import time

import pytest
import ray

from eagle_ray.pool import PoolConfig, ReplicaStartupError, TargetPool
from eagle_ray.pool.failures import startup_error
from eagle_ray.tiny import build_tiny_target

from pool_helpers import placement_groups, replica_indices

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_test")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A Llama-3.1-shaped tiny checkpoint (131,072 positions), one without weights, and one
    without tokenizer files."""
    root = tmp_path_factory.mktemp("startup")
    long = build_tiny_target(root / "long", "llama")
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    no_weights = root / "no-weights"
    no_weights.mkdir()
    shutil.copy(long / "config.json", no_weights / "config.json")
    no_tokenizer = root / "no-tokenizer"
    no_tokenizer.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(long / name, no_tokenizer / name)
    return {"long": long, "no_weights": no_weights, "no_tokenizer": no_tokenizer}


CASES = {  # failure class: (checkpoint, vllm_kwargs, the engine's words, the key named)
    "kv_cache_too_small": ("long", {}, "max seq len", "max_model_len"),
    "unknown_vllm_kwarg": ("long", {"max_model_len": 256, "not_a_vllm_option": 1},
                           "not_a_vllm_option", "target.vllm_kwargs"),
    "no_weights": ("no_weights", {}, "safetensors", "target.model_path"),
    # A weights-only folder serves (no tokenizer needed); a tokenizer named but missing fails.
    "missing_tokenizer": ("no_tokenizer", {"max_model_len": 256,
                                           "tokenizer": "/nonexistent/tokenizer"},
                          "tokenizer", "tokenizer"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_replica_that_cannot_start_fails_the_pool_at_once_with_the_engines_reason(
        cluster, checkpoints, case):
    checkpoint, vllm_kwargs, words, key = CASES[case]
    config = PoolConfig(model_path=str(checkpoints[checkpoint]), backend="vllm",
                        dtype="float32", vllm_kwargs=vllm_kwargs, name=f"startup-{case}",
                        namespace="eagle_ray_test", cpus_per_bundle=0.5, ready_timeout_s=600)
    started = time.monotonic()
    with pytest.raises(ReplicaStartupError) as failure:
        TargetPool.create(config)
    assert time.monotonic() - started < 120, "not the ready timeout (600 s)"
    message = str(failure.value)
    assert words.lower() in message.lower() and key in message, message
    # Removed: no replica, no placement group, no router left.
    assert replica_indices(config) == [] and placement_groups(config) == []
    with pytest.raises(ValueError, match="no eagle_ray pool"):
        TargetPool.connect(config.name, config.namespace)


def test_an_unrecognised_startup_error_is_reported_as_it_is():
    assert startup_error(RuntimeError("out of luck")) == "RuntimeError: out of luck"


def test_a_pool_the_cluster_cannot_place_times_out_naming_the_missing_resources(cluster):
    config = PoolConfig(backend="eagle_ray.testing:fixed_latency_target", cpus_per_bundle=64,
                        name="startup-unplaceable", namespace="eagle_ray_test",
                        ready_timeout_s=1)
    with pytest.raises(TimeoutError, match=r"0 of 1 replicas ready after 1s: no resources yet: "
                                           r"1 placement group\(s\) pending, each "
                                           r"\{'CPU': 64\} on one node"):
        TargetPool.create(config)
    assert placement_groups(config) == []


def synthetic_config(name: str, **backend_kwargs) -> PoolConfig:
    return PoolConfig(backend="eagle_ray.testing:fixed_latency_target", cpus_per_bundle=0.5,
                      backend_kwargs=backend_kwargs, name=name, namespace="eagle_ray_test",
                      ready_timeout_s=600)


def test_a_replica_whose_process_dies_while_starting_is_not_restarted_forever(cluster, tmp_path):
    abort = tmp_path / "abort"
    abort.touch()  # every construction exits the process: no exception for the replica to keep
    config = synthetic_config("startup-abort", abort_start_while=str(abort))
    started = time.monotonic()
    with pytest.raises(ReplicaStartupError, match="process died 2 times while building") as e:
        TargetPool.create(config)
    assert time.monotonic() - started < 120, "not the ready timeout (600 s)"
    assert "ray logs actor --id" in str(e.value)
    assert replica_indices(config) == [] and placement_groups(config) == []


def test_a_shared_pool_whose_replicas_all_failed_refuses_clients_at_once(cluster, tmp_path):
    broken = tmp_path / "broken"
    broken.touch()
    config = synthetic_config("startup-shared", fail_start_while=str(broken))
    pool = TargetPool.create(config, wait=False)  # as `eagle-ray serve` leaves one running
    try:
        started = time.monotonic()
        with pytest.raises(ReplicaStartupError, match="synthetic start-up failure"):
            pool.identity(timeout_s=600)
        with pytest.raises(ReplicaStartupError, match="synthetic start-up failure"):
            pool.client()  # what a job's trainers do with a shared pool
        assert time.monotonic() - started < 120, "not the 600 s waits"
        assert pool.status()["replicas"][config.replica_name(0)]["state"] == "failed"
        # Control: a replica that starts lets both through.
        broken.unlink()
        pool.add_replica()
        assert pool.identity(timeout_s=600).vocab_size == 1024
    finally:
        pool.shutdown()
