"""Overload: 32 clients against one slow replica with a small object store. Every micro-batch is
delivered correctly, the object store never spills (the clients' windows fit in it), no process
dies, and the router's memory stays flat."""

import threading

import pytest
import ray
from ray._private.internal_api import get_memory_info_reply, get_state_from_address

from eagle_ray.pool import ClientConfig, PoolClient

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    is_correct,
    micro_batches,
    replica_status,
    synthetic_pool,
    wait_until,
)

pytestmark = pytest.mark.slow

ACTORS, CLIENTS_PER_ACTOR, WINDOW = 4, 8, 2  # 32 clients
# Hidden 1024: one micro-batch's supervision is 3 x 12 slots x 4 x 1024 x 4 B = 576 KiB, so all
# windows together (32 x 2 x 576 KiB = 36 MiB) fit the 128 MiB store, with room for the inputs.
HIDDEN = 1024
STORE_BYTES = 128 * 2**20


@pytest.fixture(scope="module", autouse=True)
def small_store_ray():
    ray.init(num_cpus=4, object_store_memory=STORE_BYTES, include_dashboard=False,
             namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class ClientGroup:
    """Several clients in one process (each in its own thread), as data-loader threads are."""

    def run(self, pool_name: str, clients: int, count: int, seed: int) -> list[dict]:
        reports = [None] * clients

        def stream(k: int) -> None:
            client = PoolClient.connect(pool_name, "eagle_ray_test",
                                        ClientConfig(max_inflight_micro_batches=WINDOW))
            inputs = micro_batches(count, seed=seed * 100 + k)
            correct = [is_correct(x, b, hidden=HIDDEN)
                       for x, b in zip(inputs, client.stream(inputs), strict=True)]
            reports[k] = {"correct": correct, "stats": client.stats}

        threads = [threading.Thread(target=stream, args=(k,)) for k in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return reports


def spilled_bytes() -> int:
    return get_memory_info_reply(get_state_from_address()).store_stats.spilled_bytes_total


def test_32_clients_on_one_slow_replica_get_everything_without_spilling():
    pool = synthetic_pool("overload", replicas=1, backend_kwargs={
        "seconds_per_call": 0.005, "hidden_size": HIDDEN})
    try:
        groups = [ClientGroup.remote() for _ in range(ACTORS)]

        def round_(count: int, seed: int) -> list[dict]:
            runs = [g.run.remote("overload", CLIENTS_PER_ACTOR, count, seed * 10 + i)
                    for i, g in enumerate(groups)]
            return [r for reports in ray.get(runs, timeout=TIMEOUT_S) for r in reports]

        round_(2, seed=0)  # warm-up: processes, imports, connections
        router_before = pool.status()["router"]["rss_bytes"]
        reports = round_(10, seed=1) + round_(10, seed=2)

        assert len(reports) == 2 * ACTORS * CLIENTS_PER_ACTOR
        assert all(len(r["correct"]) == 10 and all(r["correct"]) for r in reports)
        assert all(r["stats"].max_inflight <= WINDOW and r["stats"].retries == 0
                   for r in reports)
        assert spilled_bytes() == 0, "the clients' windows fit in the store: nothing spills"
        # The clients report outcomes to the router without waiting for it: wait to see them.
        wait_until(lambda: replica_status(pool, 0)["served_micro_batches"] == 64 + 640,
                   what="every outcome reported, no more")
        status = pool.status()
        replica = status["replicas"]["overload-replica-0"]
        assert replica["restarts"] == 0 and replica["errors"] == 0
        # 640 leases through the router and nothing of them stays: no outstanding tokens or
        # micro-batches, no demand (the router keeps counters, not per-lease records) ...
        assert replica["outstanding_tokens"] == replica["outstanding_micro_batches"] == 0
        assert status["demand_tokens"] == 0
        # ... and its memory shows no per-lease growth (a leak of ~1 KiB per lease would be
        # 0.6 MiB; the allocator's own noise stays well under the bound).
        growth = status["router"]["rss_bytes"] - router_before
        assert growth < 8 * 2**20, f"router RSS grew by {growth / 2**20:.1f} MiB"
    finally:
        pool.shutdown()
