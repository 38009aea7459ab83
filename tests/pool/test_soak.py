"""The soak's short version: `eagle-ray bench soak --quick` (the command a user runs, at its CI
size) injects faults of every kind while clients stream (replicas and a client SIGKILLed, a
replica SIGSTOPped, the router killed, replicas removed and added, micro-batches too large for
the engine's memory); nothing is lost, duplicated or wrong (`--minutes N` is the long one).
test_bench_quick leaves this benchmark to this test."""

import subprocess

import pytest

from eagle_ray.bench.soak import FAULTS

from bench_lines import EAGLE_RAY, result_lines

pytestmark = pytest.mark.slow


def test_every_fault_kind_while_streaming_loses_and_duplicates_nothing():
    done = subprocess.run([EAGLE_RAY, "bench", "soak", "--quick"], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = {line["metric"]: line["value"] for line in result_lines(done.stdout)}
    # Exactly once: every micro-batch submitted was delivered, once, right (no throughput floor:
    # the phase lasts until every fault kind was injected, however slow the machine).
    assert report["delivered"] == report["submitted"] > 0
    assert (report["lost"], report["duplicated"], report["wrong"]) == (0, 0, 0)
    assert all(report[f"faults.{fault}"] >= 1 for fault in FAULTS), report
    assert report["retries"] >= 1, "the faults hit micro-batches in flight"
    # Out of memory fails the oversized micro-batches alone, as such (none is lost or delivered).
    assert report["out_of_memory"] == report["oversized"] >= 1
    # The SIGKILLed client's leases went back: nothing stays outstanding once all are done.
    assert report["leases_taken_back"] >= 1 and report["outstanding_tokens_after"] == 0
