"""The pool's and the trainers' series in Ray's metrics system (`ray.util.metrics`), so Ray's
Prometheus export and Grafana pick them up (docs/operations.md, "Telemetry": what each one means).

Ray prefixes every name with `ray_` in Prometheus, and counters get a `_total` suffix, e.g.
`ray_eagle_ray_replica_served_tokens_total`. Each class is built once inside the actor that
reports, and tags every series with the pool's name.
"""

from __future__ import annotations

from ray.util import metrics

from eagle_ray.pool.protocol import EngineStats
from eagle_ray.pool.states import ReplicaState

REPLICA_TAGS = ("pool", "replica")


class RouterMetrics:
    """Per replica: outstanding tokens, served tokens, errors, restarts; per pool: ready
    replicas and how long lease requests waited. Reported by the router."""

    def __init__(self, pool: str) -> None:
        self.pool = pool
        self.outstanding = metrics.Gauge(
            "eagle_ray_replica_outstanding_tokens", "tokens leased and not yet released",
            tag_keys=REPLICA_TAGS)
        self.served = metrics.Counter(
            "eagle_ray_replica_served_tokens", "supervision tokens served", tag_keys=REPLICA_TAGS)
        self.errors = metrics.Counter(
            "eagle_ray_replica_errors", "micro-batches that failed on the replica",
            tag_keys=REPLICA_TAGS)
        self.restarts = metrics.Counter(
            "eagle_ray_replica_restarts", "times Ray restarted the replica",
            tag_keys=REPLICA_TAGS)
        self.engine_seconds = metrics.Gauge(
            "eagle_ray_replica_engine_seconds", "seconds the replica's engine ran since it "
            "started (its rate is the engine's utilisation)", tag_keys=REPLICA_TAGS)
        self.host_seconds = metrics.Gauge(
            "eagle_ray_replica_host_seconds", "seconds the replica's host stage spent turning "
            "engine output into supervision since it started (beside the engine)",
            tag_keys=REPLICA_TAGS)
        self.handoff_overflows = metrics.Gauge(
            "eagle_ray_replica_handoff_overflows", "requests since the replica started whose "
            "captured states found the shared-memory ring full (a file each: slower)",
            tag_keys=REPLICA_TAGS)
        self.ready = metrics.Gauge("eagle_ray_pool_ready_replicas", "replicas taking leases",
                                   tag_keys=("pool",))
        self.failed = metrics.Gauge(
            "eagle_ray_pool_failed_replicas", "replicas whose target backend could not be built "
            "(not restarted; the error is in the pool's status)", tag_keys=("pool",))
        self.lease_wait = metrics.Histogram(
            "eagle_ray_pool_lease_wait_seconds", "time a lease request waited for a replica",
            boundaries=[0.001, 0.01, 0.1, 1.0, 10.0, 100.0], tag_keys=("pool",))

    def replica(self, name: str) -> dict[str, str]:
        return {"pool": self.pool, "replica": name}

    def states(self, states: list[ReplicaState]) -> None:
        """How many of the pool's replicas are ready and how many failed to start."""
        tags = {"pool": self.pool}
        self.ready.set(sum(s is ReplicaState.READY for s in states), tags=tags)
        self.failed.set(sum(s is ReplicaState.FAILED for s in states), tags=tags)

    def engine(self, name: str, stats: EngineStats) -> None:
        """A replica's engine counters, as its latest probe answered them."""
        tags = self.replica(name)
        self.engine_seconds.set(stats.engine_s, tags=tags)
        self.host_seconds.set(stats.host_s, tags=tags)
        self.handoff_overflows.set(stats.handoff_overflows, tags=tags)


class ControllerMetrics:
    """Per autoscaled pool: replicas desired vs ready vs starting, demand, decisions."""

    def __init__(self, pool: str) -> None:
        self.tags = {"pool": pool}
        self.replicas = metrics.Gauge(
            "eagle_ray_pool_replicas", "replicas by kind: desired (the policy's wish for the "
            "demand now), ready, starting (engine loading or waiting for a node)",
            tag_keys=("pool", "kind"))
        self.demand = metrics.Gauge("eagle_ray_pool_demand_tokens",
                                    "tokens leased or waiting for a lease", tag_keys=("pool",))
        self.decisions = metrics.Counter(
            "eagle_ray_pool_scaling_decisions", "replica count changes, by direction",
            tag_keys=("pool", "direction"))


class TrainerMetrics:
    """Per training worker: supervision tokens/s and the share of step time spent waiting on
    the pool."""

    def __init__(self, run: str, rank: int) -> None:
        self.tags = {"run": run, "rank": str(rank)}
        self.tokens_per_s = metrics.Gauge(
            "eagle_ray_trainer_supervision_tokens_per_s", "supervision tokens trained per second",
            tag_keys=("run", "rank"))
        self.pool_wait_share = metrics.Gauge(
            "eagle_ray_trainer_pool_wait_share", "share of step time spent waiting on the pool",
            tag_keys=("run", "rank"))

    def report(self, tokens_per_s: float, pool_wait_share: float) -> None:
        self.tokens_per_s.set(tokens_per_s, tags=self.tags)
        self.pool_wait_share.set(pool_wait_share, tags=self.tags)
