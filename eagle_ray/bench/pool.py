"""Pool benchmarks: overhead vs an in-process backend, router rate and latency, scaling.

Each runs on a local Ray instance it starts itself and prints JSON lines with ratios measured
side by side in the same run.
"""

from __future__ import annotations

import collections
import contextlib
import os
import statistics
import threading
import time

import psutil
import ray

from eagle_ray.bench import NAMESPACE, SYNTHETIC, emit
from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
from eagle_ray.pool.engine_queue import merge_micro_batches
from eagle_ray.testing import random_micro_batch


def _start_ray() -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=16, object_store_memory=1 * 2**30, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False)


def _stream_rate(pool: TargetPool, batches: list, window: int, clients: int = 1,
                 per_call: int = 8) -> float:
    """Supervision tokens/s of `clients` clients (threads) each streaming `batches` through
    `pool` at once, at most `per_call` micro-batches a replica call."""
    streams = [pool.client(ClientConfig(max_inflight_micro_batches=window,
                                        max_inflight_tokens=1 << 30,
                                        max_micro_batches_per_call=per_call))
               for _ in range(clients)]
    for client in streams:
        list(client.stream(batches[:2]))  # warm-up
    threads = [threading.Thread(target=lambda c=c: collections.deque(c.stream(batches), 0))
               for c in streams]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    tokens = clients * sum(int(b[1].sum()) for b in batches)
    return tokens / (time.perf_counter() - start)


def run_overhead(model_path: str, shapes: list[tuple[int, int]], rounds: int = 3,
                 clients: int = 4) -> None:
    """Pool with one vLLM replica vs the same backend in this process, same micro-batches; and
    `clients` clients at once vs the in-process engine handed `clients` micro-batches as one
    call (the most the replica's merging can give). `serial` paths: a replica that takes one
    micro-batch at a time (`replica_concurrency: 1`, clients calling once per micro-batch: the
    design before merging), side by side; `call_each`: this replica, but one call per
    micro-batch (`max_micro_batches_per_call: 1`, the design before shared calls)."""
    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

    _start_ray()
    # The replicas get this machine's cores, as the in-process engine does (Ray sets the
    # actor's OMP_NUM_THREADS from its CPUs).
    pool, serial = (TargetPool.create(PoolConfig(
        model_path=model_path, dtype="float32", cpus_per_bundle=float(os.cpu_count() or 1),
        name=name, namespace=NAMESPACE, replica_concurrency=concurrency))
        for name, concurrency in (("bench-overhead", 4), ("bench-overhead-serial", 1)))
    direct = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32")
    replica = ray.get_actor(pool.config.replica_name(0), namespace=pool.config.namespace)
    try:
        for batch, seq in shapes:
            batches = [random_micro_batch(direct.vocab_size, (seq,) * batch, seed=i)
                       for i in range(12)]
            tokens = batch * seq * len(batches)
            inputs = [ray.put(tuple(t.numpy() for t in b)) for b in batches]
            merged = [merge_micro_batches(batches[i:i + clients])
                      for i in range(0, len(batches), clients)]
            busy: dict[str, list[float]] = {"pool_1_replica": [], f"pool_{clients}_clients": []}
            rates: dict[str, list[float]] = collections.defaultdict(list)
            for _ in range(rounds):  # interleaved, so drift hits all paths alike
                for path, n in (("pool_1_replica", 1), (f"pool_{clients}_clients", clients)):
                    with _engine_busy(replica) as share:
                        rates[path].append(_stream_rate(pool, batches, window=4, clients=n))
                    busy[path].append(share[0])
                    rates[f"{path}_serial"].append(_stream_rate(serial, batches, window=4,
                                                                clients=n, per_call=1))
                rates["pool_1_replica_call_each"].append(_stream_rate(pool, batches, window=4,
                                                                      per_call=1))
                start = time.perf_counter()
                for b in batches:
                    direct.generate_batch(*b)
                rates["in_process"].append(tokens / (time.perf_counter() - start))
                start = time.perf_counter()
                for b in merged:
                    direct.generate_batch(*b)
                rates[f"in_process_{clients}_merged"].append(
                    tokens / (time.perf_counter() - start))
                # The replica called directly, with the same window of 4 calls in flight and the
                # results fetched, but no client state machine and no router.
                start = time.perf_counter()
                _call_with_window(replica, inputs, window=4)
                rates["replica_calls_only"].append(tokens / (time.perf_counter() - start))
            best = {path: max(values) for path, values in rates.items()}
            for path, rate in best.items():
                baseline = (f"in_process_{clients}_merged"
                            if path.startswith(f"pool_{clients}_clients") else "in_process")
                emit("pool", "supervision_tokens_per_s", round(rate, 1), "tok/s", path=path,
                     batch=batch, seq=seq, baseline=baseline,
                     ratio=round(rate / best[baseline], 3),
                     ratio_to_in_process=round(rate / best["in_process"], 3),
                     **({"engine_busy_share": round(max(busy[path]), 3)} if path in busy else {}))
    finally:
        direct.shutdown()
        pool.shutdown()
        serial.shutdown()


@contextlib.contextmanager
def _engine_busy(replica):
    """Yields a list that holds, afterwards, the share of the time the replica's engine was busy
    (the rest it idled waiting for work)."""
    share: list[float] = []
    before = ray.get(replica.ready.remote()).engine.engine_s
    start = time.perf_counter()
    yield share
    after = ray.get(replica.ready.remote()).engine.engine_s
    share.append((after - before) / (time.perf_counter() - start))


def _call_with_window(replica, inputs: list, window: int) -> None:
    """Call `replica.generate` on every input, at most `window` in flight, fetching results."""
    pending, queue = [], list(enumerate(inputs))
    while queue or pending:
        while queue and len(pending) < window:
            pending.append(replica.generate.remote(*queue.pop(0)))
        done, pending = ray.wait(pending, num_returns=1)
        ray.get(done)


@ray.remote(num_cpus=0)
class _StreamingClient:
    """A trainer stand-in for `run_router`: streams one small micro-batch `count` times."""

    def __init__(self, pool_name: str, window: int, per_call: int) -> None:
        from eagle_ray.pool import PoolClient

        self.client = PoolClient.connect(pool_name, NAMESPACE, ClientConfig(
            max_inflight_micro_batches=window, max_micro_batches_per_call=per_call))
        self.batch = random_micro_batch(1024, (16,), seed=0)

    def warm_up(self) -> None:
        list(self.client.stream([self.batch] * 20))

    def run(self, count: int, start_at: float) -> tuple[float, float, int]:
        """(started, finished) wall-clock times of streaming `count` micro-batches, and the
        replica calls that took."""
        time.sleep(max(0.0, start_at - time.time()))
        calls = self.client.stats.replica_calls
        started = time.time()
        collections.deque(self.client.stream([self.batch] * count), 0)
        return started, time.time(), self.client.stats.replica_calls - calls


def run_router(clients: tuple[int, ...] = (1, 4, 16), seconds: float = 10.0) -> None:
    """Micro-batches/s through zero-cost replicas from 1, 4, 16 clients at once (actors), and
    the router's lease round trip measured from the driver while they stream; each with the
    micro-batches leased on a replica at once sharing a call (`max_micro_batches_per_call` 8)
    and, side by side, a call each (1, the design before)."""
    _start_ray()
    pool = TargetPool.create(PoolConfig(backend=SYNTHETIC, name="bench-router", replicas=2,
                                        cpus_per_bundle=0.5, namespace=NAMESPACE,
                                        replica_concurrency=8,
                                        max_outstanding_tokens_per_replica=1 << 30))
    try:
        rate_per_client: dict[int, float] = {}
        for n in clients:
            rates = {}
            for per_call in (1, 8):
                count = int(seconds * rate_per_client.get(per_call, 200) / n) + 20
                record = _router_round(pool, n, per_call, count)
                rates[per_call] = record["rate"]
                rate_per_client.setdefault(per_call, record["rate"])
                emit("router", "micro_batches_per_s", round(record.pop("rate"), 1), "1/s",
                     clients=n, replicas=2, backend="zero-cost",
                     micro_batches_per_call=per_call, baseline="micro_batches_per_call=1",
                     ratio=round(rates[per_call] / rates[1], 3), **record)
    finally:
        pool.shutdown()


def _router_round(pool: TargetPool, n: int, per_call: int, count: int) -> dict:
    """`n` streaming clients (at most `per_call` micro-batches a replica call) send `count`
    micro-batches each; the rate, the lease probe's latency and the router's cost."""
    actors = [_StreamingClient.remote("bench-router", 16, per_call) for _ in range(n)]
    # Every client started and warm before any streams: 16 processes importing torch on a small
    # machine would otherwise be measured along with the router.
    ray.get([a.warm_up.remote() for a in actors])
    # The router's counters and CPU are read before any client streams and after all are done:
    # the window holds exactly the micro-batches divided by below.
    before = pool.status()
    router_cpu = psutil.Process(before["router"]["pid"]).cpu_times()
    start_at = time.time() + 0.5
    runs = [a.run.remote(count, start_at) for a in actors]
    time.sleep(max(0.0, start_at - time.time()) + 0.5)
    latencies = []
    for i in range(200):
        t0 = time.perf_counter()
        grant = ray.get(pool.router.acquire.remote(i, 16, [], 10.0))
        latencies.append(time.perf_counter() - t0)
        ray.get(pool.router.release.remote(grant, 16, True))
    spans = ray.get(runs)
    after = pool.status()
    for actor in actors:
        ray.kill(actor)
    cpu_s = sum(psutil.Process(before["router"]["pid"]).cpu_times()[:2]) - sum(router_cpu[:2])
    served = n * count + 200  # the clients' micro-batches and the probe's leases
    latencies.sort()
    return {
        "rate": n * count / (max(e for _, e, _ in spans) - min(s for s, _, _ in spans)),
        "lease_ms_median": round(statistics.median(latencies) * 1e3, 3),
        "lease_ms_p99": round(latencies[int(0.99 * len(latencies))] * 1e3, 3),
        # The probe's 200 single leases (two calls each) are not the clients'.
        "router_calls_per_micro_batch": round(
            (after["lease_calls"] - before["lease_calls"] - 400) / (n * count), 4),
        "replica_calls_per_micro_batch": round(sum(c for _, _, c in spans) / (n * count), 4),
        "reused_lease_share": round(1 - (after["leases"] - before["leases"] - 200) / (n * count),
                                    3),
        # The router's own CPU per micro-batch (probe included): the rate one router core
        # sustains, whatever the clients and replicas on this machine manage.
        "router_cpu_ms_per_micro_batch": round(cpu_s / served * 1e3, 4),
        "router_capacity_micro_batches_per_s": round(served / cpu_s, 1),
    }


def run_scaling(replica_counts: tuple[int, ...] = (1, 2, 4, 8),
                seconds_per_call: float = 0.05) -> None:
    """Throughput with N fixed-latency replicas vs N x the single-replica throughput."""
    _start_ray()
    rates = {}
    for n in replica_counts:
        pool = TargetPool.create(PoolConfig(
            backend=SYNTHETIC, name=f"bench-scale-{n}", replicas=n, cpus_per_bundle=0.1,
            namespace=NAMESPACE, backend_kwargs={"seconds_per_call": seconds_per_call}))
        try:
            batches = [random_micro_batch(1024, (64,) * 4, seed=i) for i in range(20 * n)]
            rates[n] = _stream_rate(pool, batches, window=2 * n + 2)
        finally:
            pool.shutdown()
        ideal = rates[replica_counts[0]] * n / replica_counts[0]
        emit("scaling", "supervision_tokens_per_s", round(rates[n], 1), "tok/s", replicas=n,
             seconds_per_call=seconds_per_call, baseline="linear", ratio=round(rates[n] / ideal, 3))
