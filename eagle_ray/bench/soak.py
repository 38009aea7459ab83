"""Soak: clients stream while faults are injected at random; nothing may be lost or duplicated.

Several client actors stream micro-batches from a pool of fixed-latency replicas and check every
result against its own input. Meanwhile a fault injector, at random moments, SIGKILLs a replica
process, SIGSTOPs one for longer than the clients' per-attempt timeout and resumes it (its late
results must be dropped), kills the router (Ray restarts it), removes a replica (draining) or
adds one, has a client send a micro-batch larger than the replicas' memory allows (its engine
runs out of memory above `OUT_OF_MEMORY_ABOVE_TOKENS`: that micro-batch must fail with
`MicroBatchOutOfMemory` and nothing else may), and SIGKILLs a client process holding leases (a
new client takes its place; the router must take its leases back). Reported: micro-batches
delivered, lost, duplicated and wrong (all three must be 0) by the clients alive at the end,
oversized micro-batches that failed as out of memory, leases taken back and the tokens still
outstanding once every client is done (must be 0), the faults injected, and the throughput kept
against a fault-free run of the same length in the same process (ratio).
"""

from __future__ import annotations

import collections
import logging
import os
import random
import signal
import time
from typing import Any

import ray
import torch

from eagle_ray.bench import NAMESPACE, SYNTHETIC, emit
from eagle_ray.config import ClientConfig, PoolConfig
from eagle_ray.pool import MicroBatchFailed, MicroBatchOutOfMemory, PoolClient, TargetPool
from eagle_ray.pool.states import ReplicaState
from eagle_ray.testing import random_micro_batch, synthetic_aux_states

logger = logging.getLogger(__name__)

HIDDEN, VOCAB = 8, 1024
FAULTS = ("sigkill_replica", "sigstop_replica", "kill_router", "remove_replica", "add_replica",
          "oversized_micro_batch", "sigkill_client")
OUT_OF_MEMORY_ABOVE_TOKENS = 256  # a replica's engine runs out of memory above this (merged)
CLIENT = ClientConfig(max_inflight_micro_batches=4, timeout_s=2.0, max_attempts=8,
                      lease_timeout_s=120.0)


@ray.remote(num_cpus=0, max_concurrency=2)
class SoakClient:
    """Streams micro-batches until told to stop; checks every result against its input."""

    def __init__(self, pool_name: str, namespace: str, seed: int) -> None:
        self.pool = (pool_name, namespace)
        self.seed = seed
        self.stopping = False
        self.oversized = 0  # micro-batches too large for the engine's memory still to send
        self.tokens = 0  # delivered so far (read by `progress` from the other thread)

    def stop(self) -> None:
        self.stopping = True

    def progress(self) -> int:
        return self.tokens

    def send_oversized(self) -> None:
        self.oversized += 1

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> dict[str, int]:
        client = PoolClient.connect(*self.pool, CLIENT)
        counts = dict.fromkeys(("delivered", "lost", "duplicated", "wrong", "tokens",
                                "oversized", "out_of_memory"), 0)
        inputs: dict[int, tuple] = {}  # micro-batch id -> its inputs, until delivered
        oversized: set[int] = set()  # ids sent to run out of memory
        order: collections.deque[int] = collections.deque()  # ids in submission order
        seen: set[int] = set()
        index = 0
        while not self.stopping or client.num_inflight:
            while not self.stopping and client.num_inflight < CLIENT.max_inflight_micro_batches:
                lengths = (12, 5, 9)
                if self.oversized:
                    self.oversized -= 1
                    counts["oversized"] += 1
                    lengths = (OUT_OF_MEMORY_ABOVE_TOKENS,) * 2
                batch = random_micro_batch(VOCAB, lengths, seed=self.seed * 10**6 + index)
                order.append(client.submit(*batch))
                inputs[order[-1]] = batch
                if lengths[0] == OUT_OF_MEMORY_ABOVE_TOKENS:
                    oversized.add(order[-1])
                index += 1
            oldest = order.popleft()  # results come in submission order, failures too
            try:
                micro_batch_id, result = client.next_result()
            except MicroBatchOutOfMemory:  # expected of an oversized one (else counted lost)
                if oldest in oversized:
                    counts["out_of_memory"] += 1
                    inputs.pop(oldest)
                continue
            except MicroBatchFailed:
                continue  # counted as lost below: its inputs stay in `inputs`
            if micro_batch_id in seen:  # delivered twice: counted, never checked again
                counts["duplicated"] += 1
                continue
            seen.add(micro_batch_id)
            ids, attention, _ = inputs.pop(micro_batch_id)
            reference = synthetic_aux_states(ids, HIDDEN) * attention.unsqueeze(-1)
            counts["wrong"] += not torch.equal(result.aux_hidden_states, reference)
            counts["delivered"] += 1
            counts["tokens"] += int(attention.sum())
            self.tokens = counts["tokens"]
        counts["lost"] += len(inputs)
        return {**counts, "submitted": client.stats.submitted - counts["out_of_memory"],
                "retries": client.stats.retries}


class _Clients:
    """The soak's client actors: started, one replaced after it is SIGKILLed, stopped."""

    def __init__(self, name: str, count: int, seed: int) -> None:
        self.name, self.seed = name, seed
        self.runs: dict[Any, ray.ObjectRef] = {}  # actor -> its `run()`
        for _ in range(count):
            self.start_one()

    def start_one(self) -> None:
        actor = SoakClient.remote(self.name, NAMESPACE, self.seed * 100 + len(self.runs))
        self.runs[actor] = actor.run.remote()
        self.seed += 1

    def progress(self) -> list[int]:
        return ray.get([a.progress.remote() for a in self.runs], timeout=60)

    def kill_one(self, rng: random.Random) -> None:
        """SIGKILL one client's process (it holds leases while it streams); a new one starts."""
        actor = rng.choice(list(self.runs))
        os.kill(ray.get(actor.pid.remote(), timeout=60), signal.SIGKILL)
        del self.runs[actor]
        self.start_one()

    def stop(self) -> list[dict[str, int]]:
        for actor in self.runs:
            actor.stop.remote()
        return ray.get(list(self.runs.values()), timeout=600)


def _replica_pids(pool: TargetPool) -> dict[int, int]:
    return {replica.index: replica.pid for replica in pool.pool_status().replicas.values()
            if replica.state is ReplicaState.READY and replica.pid}


def _inject(pool: TargetPool, clients: _Clients, fault: str, rng: random.Random,
            stopped: dict[int, float]) -> bool:
    """Apply one fault; False when it does not apply right now (e.g. too few replicas)."""
    if fault == "oversized_micro_batch":
        rng.choice(list(clients.runs)).send_oversized.remote()
        return True
    if fault == "sigkill_client":
        clients.kill_one(rng)
        return True
    pids = {i: p for i, p in _replica_pids(pool).items() if i not in stopped}
    if fault in ("sigkill_replica", "sigstop_replica", "remove_replica") and len(pids) < 2:
        return False
    try:
        if fault == "sigkill_replica":
            os.kill(rng.choice(sorted(pids.values())), signal.SIGKILL)
        elif fault == "sigstop_replica":
            index = rng.choice(sorted(pids))
            os.kill(pids[index], signal.SIGSTOP)
            stopped[index] = time.monotonic() + 2.5 * CLIENT.timeout_s
    except ProcessLookupError:  # the router has not noticed an earlier kill yet
        return False
    if fault == "kill_router":
        ray.kill(pool.router, no_restart=False)
    elif fault == "remove_replica":
        pool.remove_replica(rng.choice(sorted(pids)))
    elif fault == "add_replica":
        if len(pool.status()["replicas"]) >= 4:
            return False
        pool.add_replica()
    return True


def _resume_due(pool: TargetPool, stopped: dict[int, float], force: bool = False) -> None:
    for index, due in list(stopped.items()):
        if force or time.monotonic() >= due:
            pid = pool.status()["replicas"].get(pool.config.replica_name(index), {}).get("pid")
            if pid:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            del stopped[index]


def _outstanding_after(pool: TargetPool, timeout_s: float = 60.0) -> int:
    """Tokens still leased once every client is done (0 once the router took back what dead
    clients held, within a few seconds; waited for up to `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while (tokens := pool.status()["demand_tokens"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    return tokens


def run_phase(seconds: float, clients: int, faults: bool, seed: int,
              cycle_faults: bool = False) -> dict[str, Any]:
    """One soak phase on a fresh pool; returns the clients' totals and the faults injected.

    Faults come in random order, or with `cycle_faults` in turn (each waiting until it applies);
    a cycling phase then lasts `seconds` and at least until every kind was injected once, so a
    short run on a slow machine still covers them all (a replica restart can hold up the next
    fault that needs two ready replicas).
    """
    name = f"soak-{'faults' if faults else 'clean'}-{seed}"
    pool = TargetPool.create(PoolConfig(
        backend=SYNTHETIC, name=name, namespace=NAMESPACE, replicas=3,
        cpus_per_bundle=0.25, backend_kwargs={
            "seconds_per_call": 0.01, "hidden_size": HIDDEN, "vocab_size": VOCAB,
            "out_of_memory_above_tokens": OUT_OF_MEMORY_ABOVE_TOKENS}))
    rng = random.Random(seed)
    injected = dict.fromkeys(FAULTS, 0)
    stopped: dict[int, float] = {}
    try:
        streaming = _Clients(name, clients, seed)
        # The clock starts once every client streams (actor start-up is not part of the soak).
        deadline = time.monotonic() + 300
        while not all(streaming.progress()):
            if time.monotonic() > deadline:
                raise TimeoutError("soak clients did not start streaming within 300 s")
            time.sleep(0.2)
        tokens_at_start = sum(streaming.progress())
        started = time.monotonic()
        while time.monotonic() - started < seconds or (cycle_faults and faults
                                                       and not all(injected.values())):
            if time.monotonic() - started > seconds + 300:
                raise TimeoutError(f"soak: faults still not applicable after 300 s: {injected}")
            time.sleep(rng.uniform(0.5, 1.5))
            _resume_due(pool, stopped)
            if faults:
                fault = FAULTS[sum(injected.values()) % len(FAULTS)] if cycle_faults \
                    else rng.choice(FAULTS)
                if _inject(pool, streaming, fault, rng, stopped):
                    injected[fault] += 1
                    logger.info("soak: %s", fault)
        _resume_due(pool, stopped, force=True)
        elapsed = time.monotonic() - started
        reports = streaming.stop()
        outstanding = _outstanding_after(pool)
        taken_back = pool.status()["leases_taken_back"]
    finally:
        pool.shutdown()
    totals = {key: sum(r[key] for r in reports) for key in reports[0]}
    rate = (totals["tokens"] - tokens_at_start) / elapsed
    return {**totals, "tokens_per_s": rate, "faults": injected,
            "outstanding_tokens_after": outstanding, "leases_taken_back": taken_back}


def run(minutes: float = 1.0, clients: int = 4, seed: int = 0, cycle_faults: bool = False
        ) -> dict[str, Any]:
    """A fault-free phase, then a phase with faults, each `minutes` long; JSON lines out
    (`cycle_faults`: the fault phase lasts until every kind was injected, see `run_phase`)."""
    if not ray.is_initialized():
        ray.init(num_cpus=8, object_store_memory=512 * 2**20, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False)
    clean = run_phase(minutes * 60, clients, faults=False, seed=seed)
    faulty = run_phase(minutes * 60, clients, faults=True, seed=seed + 1,
                       cycle_faults=cycle_faults)
    for key in ("submitted", "delivered", "lost", "duplicated", "wrong", "retries", "oversized",
                "out_of_memory"):
        emit("soak", key, faulty[key], "micro-batches", minutes=minutes, clients=clients)
    emit("soak", "leases_taken_back", faulty["leases_taken_back"], "leases", minutes=minutes)
    emit("soak", "outstanding_tokens_after", faulty["outstanding_tokens_after"], "tokens",
         minutes=minutes)
    for fault, count in faulty["faults"].items():
        emit("soak", f"faults.{fault}", count, "faults", minutes=minutes)
    emit("soak", "supervision_tokens_per_s", round(faulty["tokens_per_s"], 1), "tok/s",
         baseline="fault_free", ratio=round(faulty["tokens_per_s"] / clean["tokens_per_s"], 3),
         fault_free=round(clean["tokens_per_s"], 1))
    return {"clean": clean, "faults": faulty}
