"""Two faults a real cluster has every day: an engine that runs out of memory on a large
micro-batch, and a trainer killed while it holds leases. Each with its control: the same run
without the fault."""

import os
import signal
import threading

import pytest
import ray

from eagle_ray.pool import ClientConfig, MicroBatchOutOfMemory, PoolClient
from eagle_ray.pool.leases import GRACE_S, LeaseBook
from eagle_ray.pool.protocol import LeaseOwner
from eagle_ray.testing import random_micro_batch

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    VOCAB,
    TrainerStandIn,
    is_correct,
    micro_batches,
    replica_handle,
    replica_status,
    running_ray,
    synthetic_pool,
    wait_until,
)

pytestmark = pytest.mark.slow

LIMIT = 200  # the synthetic engine runs out of memory on calls of more tokens
LARGE = (120, 120)  # a micro-batch of 240 tokens: over the limit on any replica
CLIENTS = 3


@pytest.fixture(scope="module", autouse=True)
def cluster():
    with running_ray(num_cpus=4, namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH):
        yield


def mixed_stream(pool_name: str, seed: int) -> list:
    """Small micro-batches with a large one every fifth, submitted through one client's window;
    each answer in order: `(inputs, result or the error raised for it)`."""
    client = PoolClient.connect(pool_name, "eagle_ray_test",
                                ClientConfig(max_inflight_micro_batches=16))
    inputs = [random_micro_batch(VOCAB, LARGE, seed=seed * 100 + i) if i % 5 == 4
              else micro_batches(1, seed * 100 + i)[0] for i in range(15)]
    ids = [client.submit(*batch) for batch in inputs]
    answers = []
    for micro_batch_id in ids:
        try:
            answers.append(client.result(micro_batch_id))
        except MicroBatchOutOfMemory as e:
            answers.append(e)
    return list(zip(inputs, answers, strict=True))


def clients_streaming(pool_name: str) -> list:
    results: list = [None] * CLIENTS

    def one(k: int) -> None:
        results[k] = mixed_stream(pool_name, seed=k)
    threads = [threading.Thread(target=one, args=(k,)) for k in range(CLIENTS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S)
    return [answer for per_client in results for answer in per_client]


@pytest.mark.parametrize("fault", [True, False])
def test_a_micro_batch_out_of_memory_fails_alone_and_the_replicas_stay_up(fault):
    pool = synthetic_pool(f"oom-{fault}", replicas=2, max_tokens_per_engine_call=4096,
                          backend_kwargs={"out_of_memory_above_tokens": LIMIT if fault else None})
    try:
        answers = clients_streaming(pool.config.name)
        small = [(x, a) for x, a in answers if int(x[1].sum()) <= LIMIT]
        large = [(x, a) for x, a in answers if int(x[1].sum()) > LIMIT]
        assert len(large) == CLIENTS * 3 and len(small) == CLIENTS * 12
        # Every small micro-batch arrives, right: merged with a large one or not.
        assert all(is_correct(x, a) for x, a in small)
        if fault:
            for _, error in large:
                assert isinstance(error, MicroBatchOutOfMemory), error
                assert "ran out of memory" in str(error) and "240 tokens" in str(error)
                assert "max_tokens_per_micro_batch" in str(error)
        else:  # the control: the same stream without the fault serves every large one
            assert all(is_correct(x, a) for x, a in large)
        restarts = [replica_status(pool, i)["restarts"] for i in range(2)]
        assert restarts == [0, 0], "running out of memory is not a reason to restart"
        fresh = PoolClient.connect(pool.config.name, "eagle_ray_test")
        inputs = micro_batches(4, seed=99)
        assert all(is_correct(x, b) for x, b in zip(inputs, fresh.stream(inputs), strict=True))
    finally:
        pool.shutdown()


def test_an_engine_broken_by_running_out_of_memory_is_restarted():
    """Its check after the error (a small micro-batch, with the self-check) fails: the replica
    builds a new engine (in its process: the error's answer is not lost with it), once per
    replica the micro-batch was tried on; nothing else is lost."""
    pool = synthetic_pool("oom-broken", replicas=2, max_tokens_per_engine_call=4096,
                          backend_kwargs={"out_of_memory_above_tokens": LIMIT,
                                          "broken_by_out_of_memory": True})
    try:
        client = PoolClient.connect(pool.config.name, "eagle_ray_test")
        large = client.submit(*random_micro_batch(VOCAB, LARGE, seed=1))
        with pytest.raises(MicroBatchOutOfMemory, match="240 tokens"):
            client.result(large)
        inputs = micro_batches(6, seed=5)
        assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
        # Tried on both replicas (one retry), each broken by it and its engine rebuilt once.
        engines = [ray.get(replica_handle(pool, i).ready.remote(), timeout=TIMEOUT_S).engine
                   for i in range(2)]
        assert [e.engine_restarts for e in engines] == [1, 1]
        assert [replica_status(pool, i)["restarts"] for i in range(2)] == [0, 0]
    finally:
        pool.shutdown()


def outstanding(pool) -> int:
    return pool.status()["demand_tokens"]


@pytest.mark.parametrize("killed", [True, False])
def test_a_killed_clients_leases_go_back_and_the_replica_drains(tmp_path, killed):
    """A trainer holds leases on held replicas; SIGKILLed, its tokens are back at zero on the
    router within seconds (not its 600 s term: Ray says its process is gone), and the replica
    drains; the control keeps its trainer alive, whose leases stay."""
    gate = tmp_path / "hold"
    gate.touch()
    pool = synthetic_pool(f"leak-{killed}", replicas=2, backend_kwargs={"hold_while": str(gate)})
    try:
        trainer = TrainerStandIn.options(max_restarts=0).remote(pool.config.name)
        run = trainer.run.remote(8, seed=3)
        wait_until(lambda: outstanding(pool) > 0, what="the trainer's leases")
        held = outstanding(pool)
        if killed:
            os.kill(ray.get(trainer.pid.remote(), timeout=TIMEOUT_S), signal.SIGKILL)
            wait_until(lambda: outstanding(pool) == 0, timeout_s=GRACE_S,
                       what="the dead trainer's tokens back on the router")
            assert pool.status()["leases_taken_back"] >= 1
        else:
            # A live client's lease is never taken back within its term, whatever the router
            # checks meanwhile (it checks owners twice a second).
            wait_until(lambda: pool.status()["lease_calls"] > 0)
            threading.Event().wait(3)
            assert outstanding(pool) == held and pool.status()["leases_taken_back"] == 0
        gate.unlink()
        if not killed:
            assert all(ray.get(run, timeout=TIMEOUT_S)["correct"])
        # Draining then proceeds (every lease is back) and another client gets everything.
        drained = pool.router.remove_replica.remote(pool.config.replica_name(0), True, 60.0)
        assert ray.get(drained, timeout=TIMEOUT_S), "drained before its timeout"
        survivor = PoolClient.connect(pool.config.name, "eagle_ray_test")
        inputs = micro_batches(6, seed=4)
        assert all(is_correct(x, b) for x, b in zip(inputs, survivor.stream(inputs),
                                                    strict=True))
    finally:
        pool.shutdown()


def test_the_lease_book_takes_back_what_a_dead_or_silent_owner_held_and_counts_it_once():
    book = LeaseBook()
    alive = LeaseOwner("alive", [None], term_s=10.0)
    dead = LeaseOwner("dead", [None], term_s=10.0)
    kept = book.grant("replica-0", 100, alive, now=0.0)
    lost = [book.grant("replica-1", 50, dead, now=0.0) for _ in range(2)]
    assert sorted(o.key for o in book.owners()) == ["alive", "dead"]
    taken = book.owner_gone("dead")
    assert [(t.replica, t.tokens) for t in taken] == [("replica-1", 50)] * 2
    assert book.give_back(lost[0]) is None, "a late report counts no tokens twice"
    # Silent past its term (plus the grace): taken back; a report in time starts the term again.
    book.heard(kept, now=9.0)
    assert book.expired(now=9.0 + 10.0 + GRACE_S - 1) == []
    assert [t.tokens for t in book.expired(now=9.0 + 10.0 + GRACE_S)] == [100]
    assert book.give_back(kept) is None and len(book) == 0
    assert book.owners() == [], "owners holding nothing are forgotten"
