"""The soak's short version: faults of every kind while clients stream (replicas and a client
SIGKILLed, a replica SIGSTOPped, the router killed, replicas removed and added, micro-batches too
large for the engine's memory); nothing is lost, duplicated or wrong (`eagle-ray bench soak
--minutes N` is the long one)."""

import pytest
import ray

from eagle_ray.bench.soak import FAULTS, run_phase

pytestmark = pytest.mark.slow


def test_every_fault_kind_while_streaming_loses_and_duplicates_nothing():
    ray.init(num_cpus=8, object_store_memory=300 * 2**20, include_dashboard=False,
             namespace="eagle_ray_bench")
    try:
        report = run_phase(seconds=10, clients=3, faults=True, seed=7, cycle_faults=True)
    finally:
        ray.shutdown()
    # Exactly once: every micro-batch submitted was delivered, once, right (no throughput floor:
    # the phase lasts until every fault kind was injected, however slow the machine).
    assert report["delivered"] == report["submitted"] > 0
    assert (report["lost"], report["duplicated"], report["wrong"]) == (0, 0, 0)
    assert all(report["faults"][fault] >= 1 for fault in FAULTS), report["faults"]
    assert report["retries"] >= 1, "the faults hit micro-batches in flight"
    # Out of memory fails the oversized micro-batches alone, as such (none is lost or delivered).
    assert report["out_of_memory"] == report["oversized"] >= 1
    # The SIGKILLed client's leases went back: nothing stays outstanding once all are done.
    assert report["leases_taken_back"] >= 1 and report["outstanding_tokens_after"] == 0
