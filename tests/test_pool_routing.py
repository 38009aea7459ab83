"""Routing, exactly-once delivery and backpressure of the pool, with a synthetic backend.

These tests are about the pool, not the engine: replicas run `eagle_ray.testing`'s fixed-latency
backend whose output is a checkable function of its input. The real-engine pool test is
test_pool_vllm.py.
"""

import time

import pytest
import ray
import torch

from eagle_ray.pool import ClientConfig, MicroBatchFailed, PoolClient

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TrainerStandIn,
    is_correct,
    micro_batches,
    synthetic_pool,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=8, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
    yield
    ray.shutdown()


def replica_handle(pool, index):
    return ray.get_actor(pool.config.replica_name(index), namespace=pool.config.namespace)


def replica_status(pool, index):
    return pool.status()["replicas"][pool.config.replica_name(index)]


def wait_until(predicate, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.2)


def test_results_match_inputs_in_order_and_both_replicas_work():
    pool = synthetic_pool("order", backend_kwargs={"seconds_per_call": 0.02})
    try:
        client = pool.client()
        inputs = micro_batches(24, seed=1)
        results = list(client.stream(inputs))
        assert len(results) == 24
        assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True))
        wait_until(lambda: all(r["outstanding_micro_batches"] == 0
                               for r in pool.status()["replicas"].values()))
        served = [r["served_micro_batches"] for r in pool.status()["replicas"].values()]
        assert sum(served) == 24 and min(served) > 0, served
    finally:
        pool.shutdown()


def test_killed_replica_loses_nothing_and_comes_back():
    pool = synthetic_pool("kill-replica", backend_kwargs={"seconds_per_call": 0.05})
    try:
        trainers = [TrainerStandIn.remote("kill-replica") for _ in range(2)]
        runs = [t.run.remote(40, seed=s) for s, t in enumerate(trainers)]
        wait_until(lambda: replica_status(pool, 0)["served_micro_batches"] >= 3)
        ray.kill(replica_handle(pool, 0), no_restart=False)
        for result in ray.get(runs):
            assert len(result["correct"]) == 40 and all(result["correct"])
            assert result["stats"]["delivered"] == 40
        wait_until(lambda: pool.status()["replicas"]["kill-replica-replica-0"]["state"] == "ready")
        status = pool.status()["replicas"]["kill-replica-replica-0"]
        assert status["restarts"] == 1 and status["errors"] >= 1
        before = status["served_micro_batches"]
        ray.get([t.run.remote(20, seed=5 + s) for s, t in enumerate(trainers)])
        after = pool.status()["replicas"]["kill-replica-replica-0"]["served_micro_batches"]
        assert after > before, "the restarted replica takes work again"
    finally:
        pool.shutdown()


def test_killed_router_loses_no_results_and_clients_recover():
    pool = synthetic_pool("kill-router", backend_kwargs={"seconds_per_call": 0.05})
    try:
        trainers = [TrainerStandIn.remote("kill-router") for _ in range(2)]
        runs = [t.run.remote(30, seed=20 + s) for s, t in enumerate(trainers)]
        wait_until(lambda: replica_status(pool, 0)["served_micro_batches"] >= 3)
        ray.kill(pool.router, no_restart=False)
        for result in ray.get(runs):
            assert len(result["correct"]) == 30 and all(result["correct"])
        wait_until(lambda: pool.status()["ready_replicas"] == 2)
    finally:
        pool.shutdown()


def test_engine_error_reruns_the_micro_batch_on_another_replica(tmp_path):
    pool = synthetic_pool("engine-error", backend_kwargs={
        "fail_once_marker": str(tmp_path / "failed")})
    try:
        client = pool.client(ClientConfig(max_attempts=3))
        inputs = micro_batches(6, seed=3)
        poisoned = inputs[2][0].clone()
        poisoned[0, 0] = 0  # token 0 makes the first engine that sees it fail
        inputs[2] = (poisoned, inputs[2][1], inputs[2][2])
        results = list(client.stream(inputs))
        assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True))
        # The poisoned micro-batch, and any queued behind it on the dying replica, ran again.
        assert client.stats["retries"] >= 1 and (tmp_path / "failed").exists()
    finally:
        pool.shutdown()


def test_backpressure_bounds_inflight_work():
    pool = synthetic_pool("backpressure", replicas=1, max_outstanding_tokens_per_replica=60,
                          backend_kwargs={"seconds_per_call": 0.05})
    try:
        client = pool.client(ClientConfig(max_inflight_micro_batches=4))
        inputs = micro_batches(30, seed=4)  # 26 tokens each
        for x, batch in zip(inputs, client.stream(inputs), strict=True):
            assert is_correct(x, batch)
            assert client.num_inflight <= 4
        assert client.stats["max_inflight"] == 4
        peak = pool.status()["replicas"]["backpressure-replica-0"]["peak_outstanding_tokens"]
        assert 0 < peak <= 60
    finally:
        pool.shutdown()


def test_a_window_full_of_unconsumed_results_is_a_clear_error():
    pool = synthetic_pool("unconsumed", replicas=1)
    try:
        client = pool.client(ClientConfig(max_inflight_micro_batches=2))
        inputs = micro_batches(3, seed=5)
        client.submit(*inputs[0])
        client.submit(*inputs[1])
        with pytest.raises(RuntimeError, match="full of results nobody consumed"):
            client.submit(*inputs[2])
        assert is_correct(inputs[0], client.next_result()[1])
    finally:
        pool.shutdown()


def test_bad_input_is_rejected_at_the_client_before_it_travels():
    pool = synthetic_pool("bad-input", replicas=1)
    try:
        client = pool.client()
        ids, attention, loss = micro_batches(1, seed=6)[0]
        with pytest.raises(TypeError, match="integer token ids"):
            client.submit(ids.float(), attention, loss)
        with pytest.raises(ValueError, match=r"\[0, 1024\)"):
            client.submit(ids + 2000, attention, loss)
        with pytest.raises(ValueError, match="empty micro-batch"):
            client.submit(ids[:0], attention[:0], loss[:0])
        assert client.stats["submitted"] == 0
    finally:
        pool.shutdown()


def test_no_replica_gives_a_clear_error():
    pool = synthetic_pool("no-replica", replicas=1)
    try:
        client = pool.client(ClientConfig(lease_timeout_s=2))
        pool.remove_replica(0)
        with pytest.raises(MicroBatchFailed, match="no replica accepted micro-batch"):
            client.result(client.submit(*micro_batches(1, seed=7)[0]))
    finally:
        pool.shutdown()


def test_replicas_can_be_added_and_removed_while_serving():
    pool = synthetic_pool("scale", replicas=1, backend_kwargs={"seconds_per_call": 0.02})
    try:
        client = PoolClient.connect("scale", "eagle_ray_test")
        index = pool.add_replica()
        pool.wait_ready(2)
        inputs = micro_batches(10, seed=8)
        assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
        pool.remove_replica(index)
        assert list(pool.status()["replicas"]) == ["scale-replica-0"]
        inputs = micro_batches(4, seed=9)
        assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
    finally:
        pool.shutdown()


def test_results_read_from_the_object_store_are_tensors_of_the_contract():
    pool = synthetic_pool("contract", replicas=1)
    try:
        client = pool.client()
        batch = client.result(client.submit(*micro_batches(1, seed=10)[0]))
        assert batch.encoding == "last_hidden"
        assert batch.aux_hidden_states.dtype == torch.float32
        assert batch.input_ids.dtype == torch.int64
    finally:
        pool.shutdown()
