"""Does the control plane keep up at scale? The real router and controller, N trainers and M
replicas (up to 512 and 64) on one small machine, against the replicas' capacity.

Replicas are light actors that speak the replica's protocol with an H100's timing (a 16,384-token
engine call in ~0.4 s) and tiny payloads (`bench/light_replica.py`: no torch, no engine, so 64
fit), started by the pool's own controller (`PoolConfig.replica_class`) in their placement
groups, spread over several Ray nodes on this machine (`ray.cluster_utils`). Trainers are real
`PoolClient`s, each with its own window and leases, many to a process (threads of a few trainer
host actors): each streams 4,096-token micro-batches and takes a training step per result, sized
so that the N trainers together ask for the M replicas' capacity (`load` 1.0). The router's cap
on outstanding tokens is lifted (as in `bench router`): no lease waits for room on a replica, so
what a lease costs is the router's and the clients' own time.

Per setting, over a measurement window after a warm-up: micro-batches/s delivered against the
replicas' capacity; the lease round trip as trainers see it (`acquire_many` sent to the
router's answer arriving: p50 and p99), against the 1-trainer setting measured in the same run;
the router's and the controller's CPU seconds per second (from their processes); router calls
per micro-batch; the share of micro-batches run on a reused lease; and the share of trainer time
spent waiting for a lease (blocked on a micro-batch that has none yet). The trainer hosts' and
replicas' CPU shows where the rest of the machine went.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import statistics
import threading
import time
from typing import Any

import psutil
import ray

from eagle_ray.bench import NAMESPACE, SYNTHETIC, emit
from eagle_ray.bench.light_replica import CLASS, H100_SECONDS_PER_TOKEN
from eagle_ray.bench.transport import simulated_nodes
from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
from eagle_ray.pool.client import PoolClient
from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.testing import random_micro_batch

logger = logging.getLogger(__name__)

SETTINGS = ((1, 1), (8, 2), (64, 8), (512, 64))  # (trainers, replicas); the first: the baseline
ROWS, SEQ = 2, 2048  # a micro-batch: 4,096 tokens (the 8B recipes' two rows)
REPLICA_SLOT = "scale_replica"  # a node resource: replicas are spread over the worker nodes
WITHOUT_LEASE = (MicroBatchPhase.LEASING, MicroBatchPhase.BACKOFF)


class _MeasuredClient(PoolClient):
    """A `PoolClient` that times what the benchmark reports: each lease round trip (its
    `acquire_many` sent to the router's answer arriving, timed by a callback on the answer, not
    when the trainer next looks: that waits for its training step) and the time its caller is
    blocked on a micro-batch that has no lease yet (`lease_wait_s`; the rest of its blocked
    time is `stats.wait_seconds`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lease_trips: list[float] = []
        self.lease_wait_s = 0.0
        self._timed: set[ray.ObjectRef] = set()  # router answers timed, still held by items

    def _ask_for_leases(self) -> None:
        super()._ask_for_leases()
        asked = {i.lease_ref: i.asked_at for i in self._inflight.values() if i.lease_ref}
        self._timed &= asked.keys()  # an answer read since is no item's any more
        for ref, at in asked.items():
            if ref not in self._timed:  # timed once, however long it waits to be read
                self._timed.add(ref)
                ref.future().add_done_callback(
                    lambda _, at=at: self.lease_trips.append(time.monotonic() - at))

    def _result(self, micro_batch_id: int) -> Any:
        item = self._inflight.get(micro_batch_id)
        started = time.monotonic()
        while item is not None and item.phase in WITHOUT_LEASE:
            self._pump(timeout=1.0)
        self.lease_wait_s += time.monotonic() - started
        return super()._result(micro_batch_id)


@ray.remote(num_cpus=0, scheduling_strategy="SPREAD")
class _TrainerHost:
    """`count` simulated trainers as threads of one process: each a `_MeasuredClient` streaming
    one micro-batch again and again, with a training step of `step_s` after each result."""

    def __init__(self, pool_name: str, count: int, step_s: float, lease_reuse_s: float) -> None:
        self.step_s = step_s
        ids, attention, loss = random_micro_batch(1024, (SEQ,) * ROWS)
        # int32 ids and bool masks: 24 KiB, inside the replica call (no object-store put)
        self.batch = (ids.int(), attention.bool(), loss.bool())
        config = ClientConfig(lease_reuse_s=lease_reuse_s)
        with concurrent.futures.ThreadPoolExecutor(8) as connecting:  # two router calls each
            self.clients = list(connecting.map(
                lambda _: _MeasuredClient.connect(pool_name, NAMESPACE, config), range(count)))
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._train, args=(c,), daemon=True)
                        for c in self.clients]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _train(self, client: _MeasuredClient) -> None:
        try:
            for _ in client.stream(iter(lambda: self.batch, None)):
                if self.stop.is_set():
                    return
                time.sleep(self.step_s)  # the draft's training step on this micro-batch
        except Exception as e:  # reported by `mark`: a benchmark must not hide a failure
            self.errors.append(f"{type(e).__name__}: {e}")

    def mark(self) -> dict[str, Any]:
        """Counters summed over this host's trainers now, and the lease round trips since the
        last mark."""
        trips = []
        for client in self.clients:
            trips += client.lease_trips
            client.lease_trips = []
        return {"at": time.monotonic(), "cpu_s": time.process_time(), "trips": trips,
                "delivered": sum(c.stats.delivered for c in self.clients),
                "reused": sum(c.stats.reused_leases for c in self.clients),
                "lease_wait_s": sum(c.lease_wait_s for c in self.clients),
                "errors": list(self.errors)}

    def finish(self) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=10.0)


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds of these processes so far."""
    return sum(sum(psutil.Process(pid).cpu_times()[:2]) for pid in pids)


def _snapshot(pool: TargetPool, pids: dict[str, list[int]], hosts: list) -> dict[str, Any]:
    status = pool.status()
    return {"at": time.monotonic(), "status": status, "hosts": ray.get([h.mark.remote()
                                                                         for h in hosts]),
            "cpu": {role: _cpu_s(p) for role, p in pids.items()}}


def _measure(trainers: int, replicas: int, seconds: float, warm_up_s: float, per_host: int,
             load: float, lease_reuse_s: float) -> dict[str, Any]:
    """One setting: a pool of `replicas`, `trainers` streaming; the figures over `seconds`."""
    capacity = replicas / (ROWS * SEQ * H100_SECONDS_PER_TOKEN)  # micro-batches/s
    pool = TargetPool.create(PoolConfig(
        backend=SYNTHETIC, replica_class=CLASS, name=f"bench-scale-{trainers}x{replicas}",
        namespace=NAMESPACE, replicas=replicas, cpus_per_bundle=0.01,
        bundle_resources={REPLICA_SLOT: 1}, max_outstanding_tokens_per_replica=1 << 30))
    hosts = []
    try:
        step_s = trainers / (load * capacity)
        sizes = [min(per_host, trainers - i) for i in range(0, trainers, per_host)]
        hosts = [_TrainerHost.remote(pool.config.name, n, step_s, lease_reuse_s)
                 for n in sizes]
        # Every trainer connected before any streams: connecting is not what is measured.
        ray.get([h.__ray_ready__.remote() for h in hosts])
        ray.get([h.start.remote() for h in hosts])
        logger.info("scale %dx%d: %d trainers streaming (step %.2fs); warming up %.0fs",
                    trainers, replicas, trainers, step_s, warm_up_s)
        time.sleep(warm_up_s)
        status = pool.status()
        controller = ray.get(pool.controller.__ray_call__.remote(lambda self: os.getpid()))
        logger.info("router pid %d, controller pid %d", status["router"]["pid"], controller)
        pids = {"router": [status["router"]["pid"]], "controller": [controller],
                "replicas": [r["pid"] for r in status["replicas"].values()]}
        before = _snapshot(pool, pids, hosts)
        time.sleep(seconds)
        after = _snapshot(pool, pids, hosts)
        ray.get([h.finish.remote() for h in hosts])
    finally:
        for host in hosts:
            ray.kill(host)
        pool.shutdown()
    return _figures(before, after, trainers, capacity)


def _figures(before: dict, after: dict, trainers: int, capacity: float) -> dict[str, Any]:
    """What one setting's two snapshots say."""
    errors = [e for host in after["hosts"] for e in host["errors"]]
    if errors:
        raise RuntimeError(f"{len(errors)} trainer(s) failed: {errors[:3]}")
    wall = after["at"] - before["at"]
    hosts = list(zip(before["hosts"], after["hosts"], strict=True))

    def delta(key: str) -> float:
        return sum(b[key] - a[key] for a, b in hosts)

    delivered = delta("delivered")
    trips = sorted(t for _, b in hosts for t in b["trips"])
    if not trips:
        raise RuntimeError(f"no lease round trip in {wall:.1f}s: measure for longer than the "
                           f"clients' lease_reuse_s")
    cpu = {role: (after["cpu"][role] - before["cpu"][role]) / wall for role in before["cpu"]}
    calls = after["status"]["lease_calls"] - before["status"]["lease_calls"]
    granted = after["status"]["leases"] - before["status"]["leases"]
    return {
        "micro_batches_per_s": sum((b["delivered"] - a["delivered"]) / (b["at"] - a["at"])
                                   for a, b in hosts),
        "capacity": capacity,
        "lease_round_trip_p50": statistics.median(trips),
        "lease_round_trip_p99": trips[min(len(trips) - 1, int(0.99 * len(trips)))],
        "router_cpu": cpu["router"], "controller_cpu": cpu["controller"],
        "replicas_cpu": cpu["replicas"],
        "trainer_hosts_cpu": delta("cpu_s") / wall,
        "router_calls_per_micro_batch": calls / max(delivered, 1),
        # Every run starts on a reused lease or on one the router granted in the window.
        "reused_lease_share": delta("reused") / max(delta("reused") + granted, 1),
        "lease_wait_share": delta("lease_wait_s") / (trainers * wall),
        "lease_round_trips": len(trips),
    }


def run(settings: tuple[tuple[int, int], ...] = SETTINGS, seconds: float = 30.0,
        warm_up_s: float = 10.0, nodes: int = 3, trainers_per_host: int = 64,
        load: float = 1.0, lease_reuse_s: float = ClientConfig.lease_reuse_s) -> None:
    """Each setting (trainers, replicas) in turn on one cluster of `nodes` worker nodes (plus a
    head that holds the router and the controller); the first setting is the baseline of the
    latency and CPU ratios. `lease_reuse_s`: the clients' (CI's quick run shortens it so that
    leases turn over within its few seconds)."""
    slots = math.ceil(max(m for _, m in settings) / nodes)
    with simulated_nodes(nodes, object_store_mb=128, num_cpus=64,
                         resources={REPLICA_SLOT: slots}):
        results = {}
        for trainers, replicas in settings:
            logger.info("scale: %d trainers, %d replicas", trainers, replicas)
            results[trainers, replicas] = _measure(trainers, replicas, seconds, warm_up_s,
                                                   trainers_per_host, load, lease_reuse_s)
    _emit(results, seconds, load)


def _emit(results: dict[tuple[int, int], dict[str, Any]], seconds: float, load: float) -> None:
    """A line per figure and setting; latencies and CPU also as ratios to the first setting."""
    (n0, m0), base = next(iter(results.items()))
    baseline = f"trainers={n0} replicas={m0}"
    for (trainers, replicas), r in results.items():
        setting = {"trainers": trainers, "replicas": replicas}
        emit("scale", "micro_batches_per_s", round(r["micro_batches_per_s"], 1), "1/s",
             **setting, capacity_micro_batches_per_s=round(r["capacity"], 1),
             baseline="capacity", ratio=round(r["micro_batches_per_s"] / r["capacity"], 3),
             load=load, seconds=seconds)
        for metric, unit in (("lease_round_trip_p50", "s"), ("lease_round_trip_p99", "s"),
                             ("router_cpu", "s/s"), ("controller_cpu", "s/s")):
            against = {"baseline": baseline, "ratio": round(r[metric] / base[metric], 3)} \
                if base[metric] > 0 else {}  # no CPU tick in the baseline's window: no ratio
            emit("scale", metric, round(r[metric], 5), unit, **setting, **against,
                 # a float: a count the run measured, not a setting (eagle_ray.bench.tables)
                 **({"lease_round_trips": float(r["lease_round_trips"])} if unit == "s"
                    else {}))
        emit("scale", "router_calls_per_micro_batch", round(r["router_calls_per_micro_batch"],
                                                              4), "1", **setting)
        emit("scale", "reused_lease_share", round(r["reused_lease_share"], 3), "share",
             **setting)
        emit("scale", "lease_wait_share", round(r["lease_wait_share"], 4), "share", **setting,
             trainer_hosts_cpu_s_per_s=round(r["trainer_hosts_cpu"], 3),
             replicas_cpu_s_per_s=round(r["replicas_cpu"], 3))
