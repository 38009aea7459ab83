"""Autoscaling: a demand trace (one trainer, then eight, then one) against fixed-latency replicas,
served by an autoscaled pool and by a pool fixed at the autoscaled pool's maximum, one after the
other in the same run. Reports how fast supply followed demand, how long trainers waited on the
pool, and the replica-seconds each pool held for the same work."""

from __future__ import annotations

import threading
import time

import ray

from eagle_ray.bench import NAMESPACE, SYNTHETIC, emit
from eagle_ray.config.pool import AutoscalingConfig
from eagle_ray.pool import ClientConfig, PoolClient, PoolConfig, TargetPool
from eagle_ray.testing import random_micro_batch

TOKENS = 64 * 4  # per micro-batch


@ray.remote(num_cpus=0)
class _Trainer:
    """Streams micro-batches; returns the seconds it spent and the seconds it waited."""

    def __init__(self, pool_name: str) -> None:
        self.client = PoolClient.connect(pool_name, NAMESPACE,
                                         ClientConfig(max_inflight_micro_batches=4))

    def run(self, count: int, seed: int, step_s: float = 0.1) -> tuple[float, float]:
        batches = [random_micro_batch(1024, (64,) * 4, seed=seed * 1000 + i)
                   for i in range(count)]
        start, waited = time.perf_counter(), self.client.stats.wait_seconds
        for _ in self.client.stream(batches):
            time.sleep(step_s)  # the training step
        return time.perf_counter() - start, self.client.stats.wait_seconds - waited


class _Sampler(threading.Thread):
    """Samples the pool's replica count (ready or starting) and readiness every `period` s."""

    def __init__(self, pool: TargetPool, period: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.pool, self.period, self.samples = pool, period, []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            status = self.pool.status()
            ups = (status.get("autoscaling") or {}).get("scale_ups", 0)
            self.samples.append((time.monotonic(), len(status["replicas"]),
                                 status["ready_replicas"], ups))
            time.sleep(self.period)

    def replica_seconds(self) -> float:
        """Replicas held (ready or starting) integrated over the samples' own timestamps."""
        return sum(count * (later[0] - t)
                   for (t, count, _, _), later in zip(self.samples, self.samples[1:],
                                                      strict=False))

    def first(self, since: float, condition) -> float:
        """Seconds from `since` to the first sample meeting `condition`."""
        return next((t for t, *sample in self.samples if t >= since and condition(*sample)),
                    since) - since


def _serve_trace(pool: TargetPool, phases: list[tuple[int, int]]) -> dict[str, float]:
    """Run the phases with trainers started beforehand (their start-up is not the pool's)."""
    trainers = [_Trainer.remote(pool.config.name) for _ in range(max(n for n, _ in phases))]
    ray.get([t.run.remote(1, seed=999) for t in trainers])
    sampler = _Sampler(pool)
    sampler.start()
    busy = waited = 0.0
    rise_at = 0.0
    started = time.monotonic()
    for count_trainers, count in phases:
        if count_trainers > 1 and not rise_at:
            rise_at = time.monotonic()
        for seconds, wait in ray.get([t.run.remote(count, seed=s)
                                      for s, t in enumerate(trainers[:count_trainers])]):
            busy, waited = busy + seconds, waited + wait
    wall = time.monotonic() - started
    sampler.stopped.set()
    sampler.join()
    for trainer in trainers:
        ray.kill(trainer)
    peak = max(ready for _, _, ready, _ in sampler.samples)
    return {"wall_s": wall, "wait_share": waited / busy,
            "replica_seconds": sampler.replica_seconds(), "peak": peak,
            "decided_s": sampler.first(rise_at, lambda count, ready, ups: ups > 0),
            "supply_matched_s": sampler.first(rise_at, lambda count, ready, ups: ready >= peak)}


def run(max_replicas: int = 4, seconds_per_call: float = 0.05, trace_share: float = 1.0,
        peak_trainers: int = 8) -> None:
    """The trace: 1 trainer x 300 micro-batches, then `peak_trainers` x 200, then 1 x 300
    (`trace_share` of each). A trainer steps in 0.1 s and a replica serves a micro-batch in
    0.05 s: one replica keeps two trainers busy, so eight need four, and one trainer needs one."""
    if not ray.is_initialized():
        ray.init(num_cpus=8, include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    phases = [(trainers, max(1, int(count * trace_share)))
              for trainers, count in ((1, 300), (peak_trainers, 200), (1, 300))]
    results = {}
    for name, autoscaling in (("autoscaled", AutoscalingConfig(
            min_replicas=1, max_replicas=max_replicas,
            target_outstanding_tokens_per_replica=2 * TOKENS, upscale_delay_s=1.0,
            downscale_delay_s=3.0, interval_s=0.25)), ("fixed_at_max", None)):
        pool = TargetPool.create(PoolConfig(
            backend=SYNTHETIC, name=f"bench-{name}", namespace=NAMESPACE,
            replicas=1 if autoscaling else max_replicas, cpus_per_bundle=0.1,
            autoscaling=autoscaling, backend_kwargs={"seconds_per_call": seconds_per_call}))
        try:
            results[name] = _serve_trace(pool, phases)
        finally:
            pool.shutdown()
    fixed = results["fixed_at_max"]
    for name, r in results.items():
        emit("autoscale", "replica_seconds", round(r["replica_seconds"], 1), "s", pool=name,
             baseline="fixed_at_max", ratio=round(r["replica_seconds"] / fixed["replica_seconds"],
                                                  3),
             wall_s=round(r["wall_s"], 1), wall_ratio=round(r["wall_s"] / fixed["wall_s"], 3),
             pool_wait_share=round(r["wait_share"], 3), peak_ready=r["peak"],
             scale_up_decided_s=round(r["decided_s"], 1),
             supply_matched_s=round(r["supply_matched_s"], 1))
