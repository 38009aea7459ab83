"""Routing, exactly-once delivery, failure handling and backpressure of the pool, with a synthetic
backend.

These tests are about the pool, not the engine: replicas run `eagle_ray.testing`'s fixed-latency
backend whose output is a checkable function of its input. Moments that matter (a call in
flight, a lease held) are made deterministic with the backend's `hold_while` gate, not sleeps.
The real-engine pool test is test_pool_vllm.py; router and node outages are in
test_pool_cluster.py.
"""

import threading

import numpy as np
import pytest
import ray
import torch

from eagle_ray.backends.base import SelfCheckError
from eagle_ray.contract.fp8 import ROUND_TRIP_BOUND
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool import ClientConfig, MicroBatchFailed, PoolClient, TargetPool
from eagle_ray.pool.transport import batch_from_numpy, batch_to_numpy
from eagle_ray.testing import synthetic_aux_states

from pool_helpers import (
    HIDDEN,
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    VOCAB,
    TrainerStandIn,
    engine_inside,
    is_correct,
    micro_batches,
    replica_handle,
    replica_status,
    retries,
    synthetic_pool,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def local_ray():
    ray.init(num_cpus=8, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def one_replica_pool():
    """A default one-replica pool for tests that neither break nor reconfigure it (each uses
    its own client): one replica start instead of one per test."""
    pool = synthetic_pool("one-replica", replicas=1)
    yield pool
    pool.shutdown()


@pytest.fixture
def gate(tmp_path):
    """A file that holds the synthetic replicas' calls while it exists."""
    path = tmp_path / "hold"
    path.touch()
    return path


def test_leases_pass_from_micro_batch_to_micro_batch_and_the_router_hears_of_every_one():
    pool = synthetic_pool("reuse")
    try:
        inputs = micro_batches(40, seed=2)  # all of one size: every spare lease fits the next
        for reuse_s in (60.0, 0.0):
            before = pool.status()
            client = pool.client(ClientConfig(max_inflight_micro_batches=4,
                                              lease_reuse_s=reuse_s))
            results = list(client.stream(inputs))
            assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True))
            after = pool.status()
            granted = after["leases"] - before["leases"]
            reused = client.stats.reused_leases
            assert granted + reused == 40, (granted, reused)
            if reuse_s:
                # The window's first 4 leases carried everything: each result's lease went to
                # the micro-batch that refilled its slot, with no router call.
                assert reused >= 30 and after["lease_calls"] - before["lease_calls"] < 10
            else:
                assert reused == 0
            # The outcomes still reach the router, and every lease goes back.
            wait_until(lambda b=before: sum(
                r["served_micro_batches"] - b["replicas"][name]["served_micro_batches"]
                for name, r in pool.status()["replicas"].items()) == 40
                and all(r["outstanding_tokens"] == 0 for r in pool.status()["replicas"].values()),
                what="every outcome reported and every lease handed back")
    finally:
        pool.shutdown()


def test_inputs_reused_by_the_caller_after_submit_are_served_as_submitted(one_replica_pool):
    client = one_replica_pool.client()
    inputs = micro_batches(1, seed=3)[0]
    original = tuple(t.clone() for t in inputs)
    # A fresh client holds no spare lease: the replica is called only once the router's
    # grant is read, inside result(), after the caller has overwritten its buffer.
    micro_batch_id = client.submit(*inputs)
    inputs[0].fill_(7)
    assert is_correct(original, client.result(micro_batch_id))


def test_micro_batches_leased_together_share_one_call_and_one_engine_call(one_replica_pool):
    """A stream's first micro-batches are leased in one router call and sent in one replica
    call (a call carries up to half the window); the replica merges them into one engine
    call."""
    def engine():
        return ray.get(replica_handle(one_replica_pool, 0).ready.remote(),
                       timeout=TIMEOUT_S).engine
    before = engine()
    client = one_replica_pool.client(ClientConfig(max_inflight_micro_batches=16))
    inputs = micro_batches(8, seed=30)
    results = list(client.stream(inputs))
    assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True)), "in order"
    assert client.stats.replica_calls == 1
    after = engine()
    assert (after.engine_calls - before.engine_calls,
            after.micro_batches - before.micro_batches) == (1, 8)


def test_refills_gather_into_shared_calls_while_results_wait_for_the_caller(one_replica_pool):
    client = one_replica_pool.client(ClientConfig(max_inflight_micro_batches=8))
    inputs = micro_batches(40, seed=31)
    results = list(client.stream(inputs))
    assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True)), "in order"
    # Each call's results arrive together, so the caller finds the next one waiting and refills
    # gather up to half the window (4) before they go: about 1 + 32 / 4 calls, not 40.
    assert client.stats.replica_calls <= 20, client.stats


def test_a_bad_micro_batch_in_a_shared_call_fails_alone(one_replica_pool):
    good, bad = (tuple(t.numpy() for t in b) for b in micro_batches(2, seed=32))
    bad[0][0, 0] = VOCAB  # outside the target's vocabulary
    answers = ray.get(replica_handle(one_replica_pool, 0).generate_many.remote([0, 1], good, bad),
                      timeout=TIMEOUT_S)
    assert is_correct(micro_batches(1, seed=32)[0], batch_from_numpy(answers[0]))
    assert isinstance(answers[1], ValueError) and "vocabulary" in str(answers[1])


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


def test_killed_replica_loses_nothing_and_comes_back(gate):
    """Two training actors stream while replica 0 is killed with their micro-batches inside it
    (held there by the gate, so the kill cannot land between calls): those are re-run, nothing
    is lost or repeated, and the restarted replica takes work again."""
    pool = synthetic_pool("kill-replica", backend_kwargs={"seconds_per_call": 0.05,
                                                          "hold_while": str(gate)})
    try:
        trainers = [TrainerStandIn.remote("kill-replica") for _ in range(2)]
        runs = [t.run.remote(40, seed=s) for s, t in enumerate(trainers)]
        wait_until(lambda: engine_inside(pool, 0) >= 1, what="micro-batches held inside replica 0")
        ray.kill(replica_handle(pool, 0), no_restart=False)
        wait_until(lambda: retries(trainers) >= 1, what="the calls inside replica 0 re-run")
        gate.unlink()
        results = ray.get(runs, timeout=TIMEOUT_S)
        for result in results:
            assert len(result["correct"]) == 40 and all(result["correct"])
            assert result["stats"].delivered == 40
            assert sum(result["stats"].served_by.values()) == 40, "each delivered once"
        wait_until(lambda: replica_status(pool, 0)["state"] == "ready")
        status = replica_status(pool, 0)
        assert status["restarts"] == 1 and status["errors"] >= 1
        restarted = pool.config.replica_name(0)
        before = sum(r["stats"].served_by[restarted] for r in results)
        again = ray.get([t.run.remote(20, seed=5 + s) for s, t in enumerate(trainers)],
                        timeout=TIMEOUT_S)
        assert sum(r["stats"].served_by[restarted] for r in again) > before, \
            "the restarted replica takes work again"
    finally:
        pool.shutdown()


def test_a_replica_killed_with_several_micro_batches_inside_loses_and_repeats_none(gate):
    """A replica accepts several micro-batches at once (in one call, merged into engine calls);
    killed with four inside, exactly those four are re-run elsewhere, and the stream keeps its
    order."""
    pool = synthetic_pool("kill-several", replica_concurrency=4,
                          backend_kwargs={"hold_while": str(gate)})
    try:
        client = pool.client(ClientConfig(max_inflight_micro_batches=8))
        inputs = micro_batches(20, seed=21)
        results = []
        streaming = threading.Thread(target=lambda: results.extend(client.stream(inputs)))
        streaming.start()
        wait_until(lambda: (engine_inside(pool, 0), engine_inside(pool, 1)) == (4, 4),
                   what="four micro-batches inside each replica, the engines held")
        assert client.stats.replica_calls == 2, "the first window went in one call each"
        ray.kill(replica_handle(pool, 0), no_restart=False)
        wait_until(lambda: client.stats.retries == 4, what="the four lost ones re-run")
        gate.unlink()
        streaming.join(TIMEOUT_S)
        assert len(results) == 20
        assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True)), "in order"
        assert client.stats.delivered == 20 and client.stats.retries == 4
        assert sum(client.stats.served_by.values()) == 20, "each delivered once"
        engine = ray.get(replica_handle(pool, 1).ready.remote(), timeout=TIMEOUT_S).engine
        assert engine.merged_calls >= 1, "micro-batches waiting together shared a call"
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
        assert (tmp_path / "failed").exists()
        # The poisoned micro-batch (and any queued behind it on the dying replica) ran again,
        # each time on a replica other than the one it failed on.
        assert client.stats.retries >= 1
        assert client.stats.reruns_on_same_replica == 0
        # The client reports outcomes to the router without waiting for it: wait to see them.
        wait_until(lambda: sum(r["errors"] for r in pool.status()["replicas"].values()) >= 1,
                   what="the failure reported")
        failed = [r for r in pool.status()["replicas"].values() if r["errors"] >= 1]
        assert len(failed) == 1, "one replica's engine failed"
    finally:
        pool.shutdown()


def test_a_timed_out_attempt_reruns_elsewhere_and_its_late_result_is_dropped(gate):
    pool = synthetic_pool("timeout", backend_kwargs={"hold_while": str(gate),
                                                     "hold_first_call_only": True})
    try:
        # The first attempt is held until the gate opens, so it times out for sure; 10 s is
        # two orders of magnitude more than the re-run's zero-latency call needs, even loaded.
        client = pool.client(ClientConfig(timeout_s=10.0, max_attempts=2))
        inputs = micro_batches(1, seed=12)[0]
        # The first attempt is held until the gate opens, so it times out; the re-run goes to
        # the other replica (a replica it failed on is avoided) and is served there.
        batch = client.result(client.submit(*inputs))
        assert is_correct(inputs, batch)
        assert (client.stats.delivered, client.stats.retries,
                client.stats.abandoned_attempts, client.stats.reruns_on_same_replica) == (
            1, 1, 1, 0)
        held = ray.get(replica_handle(pool, 0).ready.remote(), timeout=TIMEOUT_S)
        assert held.served_micro_batches == 0, "the first attempt is still held"
        gate.unlink()
        wait_until(lambda: ray.get(replica_handle(pool, 0).ready.remote(),
                                   timeout=TIMEOUT_S).served_micro_batches == 1,
                   what="the abandoned attempt finishing late")
        assert client.stats.delivered == 1, "its late result is not delivered again"
        assert client.num_inflight == 0
    finally:
        pool.shutdown()


def test_backpressure_bounds_inflight_micro_batches_and_tokens():
    pool = synthetic_pool("backpressure", replicas=1, max_outstanding_tokens_per_replica=60,
                          backend_kwargs={"seconds_per_call": 0.05})
    try:
        client = pool.client(ClientConfig(max_inflight_micro_batches=4))
        inputs = micro_batches(30, seed=4)  # 26 tokens each
        for x, batch in zip(inputs, client.stream(inputs), strict=True):
            assert is_correct(x, batch)
            assert client.num_inflight <= 4
        assert client.stats.max_inflight == 4
        peak = replica_status(pool, 0)["peak_outstanding_tokens"]
        assert 0 < peak <= 60
        # A token window smaller than the micro-batch window is the binding one.
        by_tokens = pool.client(ClientConfig(max_inflight_micro_batches=8,
                                             max_inflight_tokens=60))
        for x, batch in zip(inputs, by_tokens.stream(inputs), strict=True):
            assert is_correct(x, batch)
            assert by_tokens.num_inflight <= 2
        assert by_tokens.stats.max_inflight == 2  # 2 x 26 tokens fit in 60, 3 do not
    finally:
        pool.shutdown()


def test_a_window_full_of_unconsumed_results_is_a_clear_error(one_replica_pool):
    client = one_replica_pool.client(ClientConfig(max_inflight_micro_batches=2))
    inputs = micro_batches(3, seed=5)
    client.submit(*inputs[0])
    client.submit(*inputs[1])
    with pytest.raises(RuntimeError, match="full of results nobody consumed"):
        client.submit(*inputs[2])
    assert is_correct(inputs[0], client.next_result()[1])


def test_bad_input_is_rejected_at_the_client_before_it_travels(one_replica_pool):
    client = one_replica_pool.client()
    ids, attention, loss = micro_batches(1, seed=6)[0]
    with pytest.raises(TypeError, match="integer token ids"):
        client.submit(ids.float(), attention, loss)
    with pytest.raises(ValueError, match=r"\[0, 1024\)"):
        client.submit(ids + 2000, attention, loss)
    with pytest.raises(ValueError, match="empty micro-batch"):
        client.submit(ids[:0], attention[:0], loss[:0])
    assert client.stats.submitted == 0


def test_a_self_check_failure_stops_the_stream_at_once_with_its_message():
    pool = synthetic_pool("self-check", backend_kwargs={"self_check_failure": True})
    try:
        client = pool.client(ClientConfig(max_attempts=4))
        with pytest.raises(SelfCheckError, match="layer-id convention"):
            list(client.stream(micro_batches(8, seed=13)))
        assert client.stats.retries == 0, "a configuration error is not re-run"
        with pytest.raises(SelfCheckError):
            client.submit(*micro_batches(1, seed=14)[0])
        # The client reports the failure to the router without waiting for it: wait to see it.
        wait_until(lambda: sum(r["errors"] for r in pool.status()["replicas"].values()) >= 1)
        restarts = sum(r["restarts"] for r in pool.status()["replicas"].values())
        assert restarts == 0, "the replicas keep running"
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


def test_connecting_to_a_pool_that_does_not_exist_fails_at_once():
    with pytest.raises(ValueError, match="no eagle_ray pool named 'nope'"):
        PoolClient.connect("nope", "eagle_ray_test")


def test_a_replica_is_drained_with_leases_out_and_an_added_one_serves(gate):
    pool = synthetic_pool("scale", replicas=1, backend_kwargs={"hold_while": str(gate)})
    try:
        client = PoolClient.connect("scale", "eagle_ray_test",
                                    ClientConfig(max_inflight_micro_batches=4))
        # Added through an attached pool: it has the pool's own config (the router keeps it),
        # so the replica it starts is built like the first one.
        attached = TargetPool.connect("scale", "eagle_ray_test")
        assert attached.config == pool.config
        index = attached.add_replica()
        pool.wait_ready(2)
        inputs = micro_batches(12, seed=8)
        results = []
        streaming = threading.Thread(target=lambda: results.extend(client.stream(inputs)))
        streaming.start()
        wait_until(lambda: replica_status(pool, index)["outstanding_micro_batches"] >= 1,
                   what="the added replica holds a lease")
        removal = {}
        remover = threading.Thread(target=lambda: removal.update(
            index=pool.remove_replica(index, drain=True)))
        remover.start()
        wait_until(lambda: replica_status(pool, index)["state"] == "draining")
        assert remover.is_alive(), "removal waits for the leases held on the replica"
        gate.unlink()
        remover.join(TIMEOUT_S)
        streaming.join(TIMEOUT_S)
        assert removal == {"index": index}
        assert all(is_correct(x, b) for x, b in zip(inputs, results, strict=True))
        assert client.stats.delivered == 12 and client.stats.retries == 0, \
            "draining finished the leases instead of abandoning them"
        assert list(pool.status()["replicas"]) == ["scale-replica-0"]
        assert client.stats.served_by[pool.config.replica_name(index)] >= 1, \
            "the added replica served some"
    finally:
        pool.shutdown()


def test_a_second_pool_of_a_running_ones_name_is_refused_and_the_first_keeps_serving(
        one_replica_pool):
    with pytest.raises(ValueError, match="a pool named 'one-replica' already runs .*eagle-ray "
                                         "shutdown --name one-replica"):
        synthetic_pool("one-replica", replicas=1)
    client = one_replica_pool.client()
    inputs = micro_batches(2, seed=24)
    assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))


def test_results_read_from_the_object_store_are_read_only_views_of_the_contract(one_replica_pool):
    client = one_replica_pool.client()
    batch = client.result(client.submit(*micro_batches(1, seed=10)[0]))
    assert batch.encoding == "last_hidden"
    assert batch.aux_hidden_states.dtype == torch.float32
    assert batch.input_ids.dtype == torch.int64
    payload = ray.get(replica_handle(one_replica_pool, 0).generate.remote(
        0, tuple(t.numpy() for t in micro_batches(1, seed=10)[0])), timeout=TIMEOUT_S)
    viewed = batch_from_numpy(payload)
    array = payload["aux_hidden_states"][0]
    assert not array.flags.writeable, "object-store memory is read-only"
    assert viewed.aux_hidden_states.data_ptr() == array.ctypes.data, "mapped, not copied"


def test_bf16_supervision_round_trips_through_the_object_store_bit_for_bit():
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 5), generator=generator)
    batch = Eagle3TargetBatch(
        torch.randn(2, 5, 12, generator=generator).bfloat16(), ids, torch.ones_like(ids),
        torch.ones_like(ids), last_hidden=torch.randn(2, 5, 4, generator=generator).bfloat16())
    payload = ray.get(ray.put(batch_to_numpy(batch)), timeout=TIMEOUT_S)
    assert payload["aux_hidden_states"][0].dtype == np.int16
    back = batch_from_numpy(payload)
    for name, tensor in batch.tensors().items():
        assert back.tensors()[name].dtype == tensor.dtype, name
        assert torch.equal(back.tensors()[name], tensor), name


def test_an_fp8_pool_ships_e4m3_bytes_and_the_client_gets_dequantised_supervision():
    pool = synthetic_pool("fp8", replicas=1, encoding_dtype="fp8")
    try:
        inputs = micro_batches(1, seed=11)[0]
        payload = ray.get(replica_handle(pool, 0).generate.remote(
            0, tuple(t.numpy() for t in inputs)), timeout=TIMEOUT_S)
        values, dtype_name, scales = payload["aux_hidden_states"]
        assert (values.dtype, dtype_name, scales.shape) == (np.uint8, "float32", (3, 12, 3))
        client = pool.client()
        batch = client.result(client.submit(*inputs))
        assert batch.aux_hidden_states.dtype == torch.float32
        expected = synthetic_aux_states(inputs[0], HIDDEN) * inputs[1].unsqueeze(-1)
        relative, _ = ROUND_TRIP_BOUND
        assert not torch.equal(batch.aux_hidden_states, expected), "quantised on the way"
        assert ((batch.aux_hidden_states - expected).abs() <= relative * expected.abs()).all()
    finally:
        pool.shutdown()
