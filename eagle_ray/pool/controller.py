"""The autoscaling controller: an actor beside the router that sizes the pool to its demand.

Every `interval_s` it reads the router's demand (tokens leased and waiting), asks
`AutoscalingPolicy` how many replicas that needs, and starts replicas -- each in a new placement
group, so on a cluster the Ray autoscaler launches the node it needs -- or drains and removes
them: no new leases, the granted ones finish, then the actor and its group go, and the Ray
autoscaler reaps the idle node. Removal takes replicas that never got a node first, then the
least loaded, newest first. Every decision is logged with its reason and counted in the pool's
status. It owns the replicas it starts (they die with it when the pool is not detached).
"""

from __future__ import annotations

import asyncio
import logging
import time

import ray
from ray.actor import ActorHandle

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.autoscaling import AutoscalingPolicy, ScalingDecision
from eagle_ray.pool.protocol import AutoscalingReport, ScalingEvent
from eagle_ray.pool.replicas import kill_replica, replica_index, start_replica
from eagle_ray.pool.states import ReplicaState
from eagle_ray.pool.telemetry import ControllerMetrics

logger = logging.getLogger(__name__)

Supply = dict[str, tuple[ReplicaState, int]]  # replicas counted as supply: state, outstanding


class PoolController:
    """Async Ray actor named `<pool name>-controller`; created by `TargetPool` when the pool's
    config has `autoscaling`."""

    def __init__(self, config: PoolConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        assert config.autoscaling is not None
        self._config = config
        self._router = ray.get_actor(config.router_name, namespace=config.namespace)
        self._policy = AutoscalingPolicy(config.autoscaling)
        self._handles: dict[int, ActorHandle] = {}  # replicas it started: it keeps them alive
        self._removing: set[str] = set()
        self._counts = {"scale_ups": 0, "scale_downs": 0, "replicas_added": 0,
                        "replicas_removed": 0}
        self._last: ScalingEvent | None = None
        self._blocked: str | None = None  # why scaling up stopped (replicas failed to start)
        self._rounds = 0
        self._metrics = ControllerMetrics(config.name)
        self._task = asyncio.get_event_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await self._tick()
            except Exception:  # keep controlling whatever one round hit
                logger.exception("autoscaling round failed")
            await asyncio.sleep(self._config.autoscaling.interval_s)

    async def _tick(self) -> None:
        demand = await self._router.demand.remote()
        failed = sorted(name for name, (state, _) in demand.replicas.items()
                        if state is ReplicaState.FAILED)
        supply = {name: (state, load) for name, (state, load) in demand.replicas.items()
                  if state not in (ReplicaState.DRAINING, ReplicaState.FAILED)
                  and name not in self._removing}
        decision = self._policy.decide(time.monotonic(), demand.tokens, len(supply))
        if decision is not None and decision.replicas > len(supply) and failed:
            # Every replica is built from the same configuration: a new one would fail alike.
            if self._blocked is None:
                logger.warning("autoscaling stops adding replicas: %s failed to start (their "
                               "error is in the pool's status)", ", ".join(failed))
            self._blocked = f"{', '.join(failed)} failed to start; not adding replicas"
            decision = None
        if decision is not None:
            await self._apply(decision, supply)
        self._rounds += 1
        await self._report(demand.tokens, supply, len(failed))

    async def _apply(self, decision: ScalingDecision, supply: Supply) -> None:
        change = decision.replicas - len(supply)
        logger.info("autoscaling %s from %d to %d replicas: %s", "up" if change > 0 else "down",
                    len(supply), decision.replicas, decision.reason)
        direction = "up" if change > 0 else "down"
        self._counts["scale_ups" if change > 0 else "scale_downs"] += 1
        self._metrics.decisions.inc(tags={**self._metrics.tags, "direction": direction})
        self._last = ScalingEvent(time.time(), len(supply), decision.replicas, decision.reason)
        for _ in range(change):
            index = await self._router.reserve_index.remote()
            self._handles[index] = start_replica(self._config, index)
            await self._router.add_replica.remote(self._config.replica_name(index),
                                                  self._handles[index])
            self._counts["replicas_added"] += 1
        for name in self._removal_order(supply)[:max(-change, 0)]:
            self._removing.add(name)
            asyncio.get_event_loop().create_task(self._remove(name))

    def _removal_order(self, supply: Supply) -> list[str]:
        """Replicas that never got a node (or an engine) first, then the least loaded, newest
        first."""
        return sorted(supply, key=lambda n: (supply[n][0] is not ReplicaState.STARTING,
                                             supply[n][1], -self._index(n)))

    async def _remove(self, name: str) -> None:
        index = self._index(name)
        try:
            if not await self._router.remove_replica.remote(name, True):
                logger.warning("replica %s did not drain in time; its micro-batches will be "
                               "re-run", name)
            kill_replica(self._config, index)
            self._counts["replicas_removed"] += 1
        except Exception:
            logger.exception("removing replica %s failed", name)
        finally:
            self._handles.pop(index, None)
            self._removing.discard(name)

    def _index(self, name: str) -> int:
        return replica_index(name, self._config.replica_prefix)

    async def _report(self, demand_tokens: int, supply: Supply,
                      failed: int) -> None:
        ready = sum(state is ReplicaState.READY for state, _ in supply.values())
        counts = {"desired": self._policy.wanted(demand_tokens), "ready": ready,
                  "starting": sum(state is ReplicaState.STARTING
                                  for state, _ in supply.values()), "failed": failed}
        for kind, value in counts.items():
            self._metrics.replicas.set(value, tags={**self._metrics.tags, "kind": kind})
        self._metrics.demand.set(demand_tokens, tags=self._metrics.tags)
        cfg = self._config.autoscaling
        await self._router.report_autoscaling.remote(AutoscalingReport(
            min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas,
            target_outstanding_tokens_per_replica=cfg.target_outstanding_tokens_per_replica,
            **counts, replicas=len(supply), removing=len(self._removing), **self._counts,
            last_decision=self._last, blocked=self._blocked, rounds=self._rounds))
