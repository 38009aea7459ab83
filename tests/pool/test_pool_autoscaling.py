"""An autoscaled pool on a real Ray instance: replicas follow demand, one never gets room, and
training rides through every change exactly once. The replicas run the synthetic backend (these
tests are about scaling); a gate holds calls so demand stays up for as long as the test decides.
"""

import collections
import urllib.request

import pytest
import ray

from eagle_ray.config.pool import AutoscalingConfig

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    TrainerStandIn,
    micro_batches,
    running_ray,
    synthetic_pool,
    wait_until,
)
from ray_heads import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def local_ray():
    """Room for two replicas (`slot`): a third, if asked for, waits like one whose node the
    cluster cannot provide. Metrics are exported every second on a port of the test's own."""
    port = free_port()
    with running_ray(num_cpus=4, resources={"slot": 2}, namespace="eagle_ray_test",
                     runtime_env=TESTS_ON_WORKER_PATH, _metrics_export_port=port,
                     _system_config={"metrics_report_interval_ms": 1000}):
        yield f"http://127.0.0.1:{port}/metrics"


def pending_groups(pool) -> int:
    return sum(info["state"] == "PENDING" for info in ray.util.placement_group_table().values()
               if info["name"].startswith(pool.config.replica_prefix))


@pytest.mark.parametrize("reuse", ["fresh-leases", "default-reuse"])
def test_replicas_follow_demand_and_training_rides_through_exactly_once(local_ray, tmp_path,
                                                                        reuse):
    gate = tmp_path / "hold"
    gate.touch()
    pool = synthetic_pool(
        "autoscale", replicas=1, bundle_resources={"slot": 1},
        backend_kwargs={"hold_while": str(gate), "seconds_per_call": 0.01},
        autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=3,
                                      target_outstanding_tokens_per_replica=100,
                                      upscale_delay_s=0.5, downscale_delay_s=1.0,
                                      interval_s=0.2))
    try:
        # fresh-leases: every micro-batch asks the router (lease_reuse_s 0), so a replica added
        # mid-run gets work at once; default-reuse: leases are passed on for 5 s (the default),
        # and reach a new replica only as they expire.
        reuse_s = {"lease_reuse_s": 0} if reuse == "fresh-leases" else {}
        trainers = [TrainerStandIn.remote("autoscale", **reuse_s) for _ in range(3)]
        runs = [t.run.remote(40, seed=90 + s) for s, t in enumerate(trainers)]
        # Three windows of 8 micro-batches (26 tokens each) held on the engine: demand ~600
        # tokens wants 6 replicas, capped at 3; the cluster has room for 2.
        wait_until(lambda: (pool.status()["autoscaling"] or {}).get("replicas") == 3,
                   what="scaled up to max_replicas")
        wait_until(lambda: pool.status()["ready_replicas"] == 2, what="two replicas ready")
        assert pending_groups(pool) == 1, "the third waits for room, the others serve"
        status = pool.status()
        assert status["autoscaling"]["scale_ups"] >= 1
        assert "above the target 100" in status["autoscaling"]["last_decision"]["reason"]

        gate.unlink()
        served = collections.Counter()
        for result in ray.get(runs, timeout=TIMEOUT_S):
            assert len(result["correct"]) == 40 and all(result["correct"])
            assert result["stats"].delivered == 40 and result["stats"].retries == 0
            served.update(result["stats"].served_by)
        assert sum(served.values()) == 120, "every micro-batch served once"
        if reuse == "fresh-leases":
            assert len(served) == 2, "the new replica took work (the third never got room)"

        # Demand gone: after the delay the pool drains back to min_replicas, the replica that
        # never got room first.
        wait_until(lambda: len(pool.status()["replicas"]) == 1
                   and pool.status()["autoscaling"]["removing"] == 0,
                   what="scaled down to min_replicas")
        status = pool.status()
        assert status["ready_replicas"] == 1 and pending_groups(pool) == 0
        assert status["autoscaling"]["scale_downs"] >= 1
        assert status["autoscaling"]["replicas_removed"] == 2
        assert "below the target" in status["autoscaling"]["last_decision"]["reason"]
        result = ray.get(trainers[0].run.remote(10, seed=99), timeout=TIMEOUT_S)
        assert all(result["correct"]), "the pool serves after scaling down"
    finally:
        pool.shutdown()


def test_replicas_that_fail_to_start_stop_the_scaling_up_and_say_why(local_ray, tmp_path):
    gate, broken = tmp_path / "hold", tmp_path / "broken"
    gate.touch()
    pool = synthetic_pool(
        "autoscale-broken", replicas=1, bundle_resources={"slot": 1},
        backend_kwargs={"hold_while": str(gate), "fail_start_while": str(broken)},
        autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=3,
                                      target_outstanding_tokens_per_replica=100,
                                      upscale_delay_s=0.2, downscale_delay_s=60.0,
                                      interval_s=0.2))
    try:
        broken.touch()  # replica 0 is up; every replica built from now on fails to start
        trainer = TrainerStandIn.remote("autoscale-broken", lease_reuse_s=0)
        run = trainer.run.remote(40, seed=7)
        wait_until(lambda: any(r["state"] == "failed" for r in pool.status()["replicas"].values()),
                   what="a new replica failed to start")
        failed = [r for r in pool.status()["replicas"].values() if r["state"] == "failed"]
        assert "synthetic start-up failure" in failed[0]["error"]
        wait_until(lambda: (pool.status()["autoscaling"] or {}).get("blocked") is not None,
                   what="autoscaling stopped adding replicas")
        report = pool.status()["autoscaling"]
        added, rounds = report["replicas_added"], report["rounds"]
        wait_until(lambda: pool.status()["autoscaling"]["rounds"] >= rounds + 10,
                   what="ten more autoscaling rounds")
        report = pool.status()["autoscaling"]
        # One decision may add several at once (demand wants 3); none is added after.
        assert report["replicas_added"] == added, "no replica added after the failure"
        assert report["failed"] >= 1 and "failed to start" in report["blocked"]
        failures = sum(r["state"] == "failed" for r in pool.status()["replicas"].values())
        # The router's and the controller's series, as Prometheus reads them.
        wait_until(lambda: scrape(local_ray, "autoscale-broken").get(
            "ray_eagle_ray_pool_failed_replicas") == failures,
            what=f"{failures} failed replica(s) in telemetry")
        wait_until(lambda: scrape(local_ray, "autoscale-broken").get(
            "ray_eagle_ray_pool_scaling_decisions_total", 0) >= 1
            and "ray_eagle_ray_pool_demand_tokens" in scrape(local_ray, "autoscale-broken"),
            what="the controller's decisions and demand in telemetry")
        # One allocator for manual adds and the controller's: a replica added by hand after an
        # autoscale-up gets a name no replica had (the pool's own counter said 1, taken).
        names = set(pool.status()["replicas"])
        assert len(names) >= 2, "the controller added replicas"
        index = pool.add_replica()
        assert pool.config.replica_name(index) not in names
        wait_until(lambda: set(pool.status()["replicas"]) == names | {
            pool.config.replica_name(index)}, what="the manual replica registered beside them")
        gate.unlink()
        result = ray.get(run, timeout=TIMEOUT_S)
        assert all(result["correct"]), "the replica that started keeps serving"
    finally:
        pool.shutdown()


def scrape(url: str, pool: str) -> dict[str, float]:
    """`{series name: value summed over the pool's samples}` from a Prometheus endpoint."""
    values: dict[str, float] = collections.defaultdict(float)
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("ray_eagle_ray_") and f'pool="{pool}"' in line:
            name, value = line.split("{")[0], float(line.rsplit(" ", 1)[1])
            values[name] += value
    return values


def test_the_pool_reports_its_series_to_prometheus(local_ray):
    pool = synthetic_pool("metrics", replicas=2)
    try:
        client = pool.client()
        inputs = micro_batches(12, seed=5)
        assert len(list(client.stream(inputs))) == 12
        wait_until(lambda: sum(r["served_micro_batches"]
                               for r in pool.status()["replicas"].values()) == 12,
                   what="every outcome recorded")
        status = pool.status()
        served = sum(r["served_tokens"] for r in status["replicas"].values())
        expected = {"ray_eagle_ray_replica_served_tokens_total": served,
                    "ray_eagle_ray_pool_ready_replicas": status["ready_replicas"],
                    "ray_eagle_ray_replica_outstanding_tokens": 0,
                    # One wait per lease the router granted (a lease may carry several).
                    "ray_eagle_ray_pool_lease_wait_seconds_count": status["leases"]}
        wait_until(lambda: all(scrape(local_ray, "metrics").get(name) == value
                               for name, value in expected.items()),
                   what=f"Prometheus series {expected}")
    finally:
        pool.shutdown()


def test_a_training_workers_series_reach_prometheus_by_run_and_rank(local_ray):
    """What each Ray Train worker reports (`TrainerMetrics`, the dashboard's trainer row), from
    a worker process, as Prometheus reads it."""
    workers = [TrainerMetricsWorker.remote(rank) for rank in (0, 1)]
    ray.get([w.report.remote(1000.0 * (rank + 1), 0.25) for rank, w in enumerate(workers)],
            timeout=TIMEOUT_S)
    expected = {'ray_eagle_ray_trainer_supervision_tokens_per_s{rank="0"': 1000.0,
                'ray_eagle_ray_trainer_supervision_tokens_per_s{rank="1"': 2000.0,
                'ray_eagle_ray_trainer_pool_wait_share{rank="0"': 0.25}
    try:  # the workers stay alive (their series with them) until the series are read
        wait_until(lambda: all(trainer_series(local_ray, "metrics-run").get(key) == value
                               for key, value in expected.items()),
                   what=f"trainer series {expected}")
    finally:
        for worker in workers:
            ray.kill(worker)


@ray.remote(num_cpus=0)
class TrainerMetricsWorker:
    """A training worker's telemetry, as `eagle_ray.train.loop` reports it."""

    def __init__(self, rank: int) -> None:
        from eagle_ray.pool.telemetry import TrainerMetrics

        self.metrics = TrainerMetrics("metrics-run", rank)

    def report(self, tokens_per_s: float, pool_wait_share: float) -> None:
        self.metrics.report(tokens_per_s, pool_wait_share)


def trainer_series(url: str, run: str) -> dict[str, float]:
    """`{'name{rank="r"': value}` of one run's trainer series from a Prometheus endpoint."""
    values = {}
    for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
        if line.startswith("ray_eagle_ray_trainer_") and f'run="{run}"' in line:
            name, labels = line.split("{")[0], line.split("{")[1].split("}")[0]
            rank = next(p for p in labels.split(",") if p.startswith("rank="))
            values[f"{name}{{{rank}"] = float(line.rsplit(" ", 1)[1])
    return values
