"""Faults a real cluster has every day: an engine that runs out of memory on a large
micro-batch, a trainer killed while it holds leases, and one that stalls past its leases' term.
Each with its control: the same run without the fault (or, for the stall, with the trainer
killed instead)."""

import os
import signal
import threading
import time

import psutil
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
    engine_inside,
    is_correct,
    micro_batches,
    replica_handle,
    replica_status,
    results_or_errors,
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
    answers = results_or_errors(client, ids, MicroBatchOutOfMemory)
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
    assert book.heard(kept, now=60.0) is False, "a late report keeps nothing alive"


def test_a_restarted_routers_book_takes_no_old_lease_for_one_of_its_own():
    """Lease ids carry their book's generation: a report on a lease the router granted before
    it restarted is late at the new one, even where the new one has granted as many leases; the
    control, the same book, knows its own."""
    owner = LeaseOwner("client", [None], term_s=10.0)
    old = LeaseBook()
    stale = [old.grant("replica-0", 10, owner, now=0.0) for _ in range(3)]
    new = LeaseBook()
    fresh = [new.grant("replica-0", 20, owner, now=0.0) for _ in range(3)]
    assert not set(stale) & set(fresh)
    assert [new.give_back(i) for i in stale] == [None] * 3 and len(new) == 3
    assert [new.heard(i, now=1.0) for i in stale] == [False] * 3
    assert [new.give_back(i).tokens for i in fresh] == [20] * 3
    assert [old.give_back(i).tokens for i in stale] == [10] * 3


# A stalled trainer's client: attempts of 4 s, leases passed on for 0.5 s, so a lease's term is
# 4.5 s; the router's grace beyond it is 1.5 s (`lease_grace_s`).
STALLED_CLIENT = {"timeout_s": 4.0, "lease_reuse_s": 0.5, "max_inflight_micro_batches": 4}
LEASE_GRACE_S = 1.5
LAPSE_S = 4.0 + 0.5 + LEASE_GRACE_S  # from its grant until the router takes a silent lease back
ONE_EACH = 26  # tokens of one micro-batch (rows of 12, 5 and 9): room for one per replica


@pytest.fixture(scope="module")
def gated_pool(tmp_path_factory):
    """Two replicas with room for one micro-batch each, held while `pool.gate` exists; shared
    by the stall and its control (each counts from what the pool showed when it began)."""
    gate = tmp_path_factory.mktemp("stall") / "hold"
    pool = synthetic_pool("stall", replicas=2, lease_grace_s=LEASE_GRACE_S,
                          max_outstanding_tokens_per_replica=ONE_EACH,
                          backend_kwargs={"hold_while": str(gate)})
    pool.gate = gate
    try:
        yield pool
    finally:
        pool.shutdown()


class Counts:
    """The router's counters since `Counts(pool)` was made."""

    KEYS = ("leases", "leases_taken_back", "late_reports", "served")

    def __init__(self, pool) -> None:
        self.pool = pool
        self.before = self.now()

    def now(self) -> dict:
        status = self.pool.status()
        status["served"] = sum(r["served_micro_batches"] for r in status["replicas"].values())
        return {key: status[key] for key in self.KEYS}

    def __getitem__(self, key: str) -> int:
        return self.now()[key] - self.before[key]


def counted(pool) -> int:
    """Micro-batches the router counts on the replicas now (their leases held)."""
    return sum(r["outstanding_micro_batches"] for r in pool.status()["replicas"].values())


def waiting_tokens(pool) -> int:
    """Tokens of lease requests waiting at the router for room."""
    return ray.get(pool.router.demand.remote(), timeout=TIMEOUT_S).waiting_tokens


def inside(pool) -> int:
    """Micro-batches on the replicas' engines now (their own count)."""
    return engine_inside(pool, 0) + engine_inside(pool, 1)


def stall(pool, pid: int, counts: Counts) -> None:
    """SIGSTOP the trainer holding its leases; SIGCONT it once the router took back all four
    (the two it granted to the stopped trainer's waiting requests too) and twice a lease's
    term plus grace has passed."""
    stopped = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    wait_until(lambda: psutil.Process(pid).status() == psutil.STATUS_STOPPED)
    # The trainer can change nothing now: it had re-run nothing before it stopped.
    assert (counts["leases"], counts["leases_taken_back"]) == (2, 0), "too slow for 4 s"
    wait_until(lambda: counts["leases_taken_back"] == 4, timeout_s=10 * LAPSE_S,
               what="the stalled trainer's four leases taken back")
    assert pool.status()["demand_tokens"] == 0
    wait_until(lambda: time.monotonic() - stopped >= 2 * LAPSE_S, timeout_s=3 * LAPSE_S)
    os.kill(pid, signal.SIGCONT)


def resumed(pool, trainer, run) -> None:
    """Back, the trainer runs two micro-batches (its room) on fresh leases and two wait for
    room: the router counts every attempt it runs, none runs on a lease taken back. Then every
    micro-batch arrives once, right, with no attempt charged."""
    wait_until(lambda: waiting_tokens(pool) == 2 * ONE_EACH
               and ray.get(trainer.running.remote(), timeout=TIMEOUT_S) == 2,
               what="the resumed trainer's re-runs leased afresh")
    assert counted(pool) == 2
    pool.gate.unlink()
    result = ray.get(run, timeout=TIMEOUT_S)
    assert result["correct"] == [True] * 8, "each micro-batch once, right"
    stats = result["stats"]
    assert (stats.delivered, stats.retries, stats.abandoned_attempts) == (8, 0, 0)
    assert stats.lapsed_leases >= 4 and sum(stats.served_by.values()) == 8


@pytest.mark.parametrize("fault", ["stalled", "killed"])
def test_a_stalled_client_gets_everything_once_and_a_killed_one_nothing(gated_pool, fault):
    """A trainer stopped (SIGSTOP) for twice its leases' term plus grace, holding two leases
    with micro-batches on held replicas and two requests waiting at the router, loses all four
    leases (the two granted meanwhile too). Back, it runs nothing on them: the two attempts run
    again on fresh leases without charging a replica or an attempt, and the two late grants go
    back unused; each micro-batch arrives once, right, and the router counts each lease, late
    report and result once. The control, killed (SIGKILL) instead: its leases come back,
    nothing of its is served or reported; another client is unaffected after either."""
    pool = gated_pool
    pool.gate.touch()
    counts = Counts(pool)
    trainer = TrainerStandIn.options(max_restarts=0).remote(pool.config.name, **STALLED_CLIENT)
    pid = ray.get(trainer.pid.remote(), timeout=TIMEOUT_S)
    run = trainer.run.remote(8, seed=6)
    wait_until(lambda: counted(pool) == 2 and waiting_tokens(pool) == 2 * ONE_EACH
               and inside(pool) == 2, what="two micro-batches on the replicas, two waiting")
    if fault == "stalled":
        stall(pool, pid, counts)
        resumed(pool, trainer, run)
    else:
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: pool.status()["leases_held"] == 0
                   and pool.status()["demand_tokens"] == 0,
                   what="the killed trainer's leases and requests back")
        pool.gate.unlink()
        wait_until(lambda: inside(pool) == 0, what="its attempts finished, for no one")
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(run, timeout=TIMEOUT_S)
    wait_until(lambda: pool.status()["leases_held"] == 0, what="every report in")
    ran = 8 if fault == "stalled" else 0
    assert counts["served"] == ran, "each result counted once, a given-up attempt's never"
    assert counts["late_reports"] == (4 if fault == "stalled" else 0)
    taken = counts["leases_taken_back"]
    assert taken == 4 if fault == "stalled" else taken in (2, 4)
    for replica in pool.status()["replicas"].values():
        assert (replica["state"], replica["errors"], replica["restarts"]) == ("ready", 0, 0)
    bystander = PoolClient.connect(pool.config.name, "eagle_ray_test")
    inputs = micro_batches(6, seed=7)
    assert all(is_correct(x, b) for x, b in zip(inputs, bystander.stream(inputs), strict=True))
    assert (bystander.stats.delivered, bystander.stats.retries) == (6, 0)
    wait_until(lambda: pool.status()["leases_held"] == 0)
    assert counts["served"] == ran + 6 and pool.status()["demand_tokens"] == 0
