"""The pool controller: the one owner of a pool's replicas, and its autoscaler.

Every replica is started, drained and stopped here (`add_replica`, `remove_replica`,
`shutdown`): the controller reserves an index and a placement group, starts the actor, keeps its
handle (a non-detached replica lives as long as the controller does, which lives as long as the
pool's creator) and registers it with the router; removing one asks the router to drain it, then
kills the actor and removes its group. `TargetPool` (a person's or a job's calls) and the
autoscaling loop both go through it, so membership has one source of truth: the router adopts
the controller's replicas (after a router restart too), and a restarted controller reads which
replicas the pool had from its record in Ray's key-value store (in the GCS, which outlives both
actors) and looks each up by the name it gave it: a detached pool's are adopted, the others died
with it and as many new ones start. Nothing lists the cluster.

With `autoscaling`, every `interval_s` it reads the router's demand (tokens leased and waiting),
asks `AutoscalingPolicy` how many replicas that needs, and adds replicas -- each in a new
placement group, so on a cluster the Ray autoscaler launches the node it needs -- or drains and
removes them, replicas that never got a node first, then the least loaded, newest first. Every
decision is logged with its reason and counted in the pool's status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.autoscaling import AutoscalingPolicy, ScalingDecision
from eagle_ray.pool.protocol import AutoscalingReport, ScalingEvent
from eagle_ray.pool.replicas import group_pending, start_replica, stop_replica
from eagle_ray.pool.states import ReplicaState
from eagle_ray.pool.telemetry import ControllerMetrics
from eagle_ray.ray_compat import kv_delete, kv_get, kv_put

logger = logging.getLogger(__name__)

Supply = dict[str, tuple[ReplicaState, int]]  # replicas counted as supply: state, outstanding
ROUTER_RESTART_WAIT_S = 120.0  # how long a call to the router (or the controller) waits out
# its restart, here and in `TargetPool`


class PoolController:
    """Async Ray actor named `<pool name>-controller`, created by `TargetPool.create` beside the
    router."""

    def __init__(self, config: PoolConfig, router: ActorHandle) -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._router = router
        self._replicas: dict[int, ActorHandle] = {}  # the pool's replicas: it keeps them alive
        self._groups: dict[int, PlacementGroup] = {}
        self._next_index = 0  # the lowest index never handed out
        self._removing: set[int] = set()
        self._record_key = f"eagle_ray:pool:{config.namespace}:{config.name}:members".encode()
        self._adopted = asyncio.get_event_loop().create_task(self._adopt())
        self._policy = AutoscalingPolicy(config.autoscaling) if config.autoscaling else None
        self._counts = {"scale_ups": 0, "scale_downs": 0, "replicas_added": 0,
                        "replicas_removed": 0}
        self._last: ScalingEvent | None = None
        self._blocked: str | None = None  # why scaling up stopped (replicas failed to start)
        self._rounds = 0
        self._metrics = ControllerMetrics(config.name)
        if self._policy is not None:
            self._task = asyncio.get_event_loop().create_task(self._autoscale_forever())

    # ------------------------------------------------------------------ membership

    async def members(self) -> dict[int, ActorHandle]:
        """The replicas the pool has (being removed ones included until they are gone)."""
        await self._adopted
        return dict(self._replicas)

    async def add_replica(self) -> int:
        """Start one replica and register it with the router; returns its index."""
        await self._adopted
        return await self._start()

    async def _start(self) -> int:
        index = self._next_index
        self._next_index += 1
        self._replicas[index], self._groups[index] = start_replica(self._config, index)
        self._record()
        await self._call_router("add_replica", index, self._replicas[index])
        return index

    def _record(self) -> None:
        """Write which replicas the pool has where a restarted controller finds them."""
        kv_put(self._record_key, json.dumps({"next_index": self._next_index,
                                             "replicas": sorted(self._replicas)}).encode())

    async def remove_replica(self, index: int | None = None, drain: bool = True) -> int:
        """Stop routing to a replica (the newest by default), drain it, kill it and remove its
        group; returns its index."""
        await self._adopted
        present = sorted(set(self._replicas) - self._removing)
        if index is None:
            if not present:
                raise ValueError("the pool has no replicas to remove")
            index = present[-1]
        if index not in present:
            raise ValueError(f"the pool has no replica {index} to remove; it has {present}")
        self._removing.add(index)
        await self._drain_and_stop(index, drain)
        return index

    async def _drain_and_stop(self, index: int, drain: bool = True) -> None:
        """Drain replica `index` (already marked as being removed), kill it, remove its group."""
        try:
            if not await self._call_router("remove_replica", self._config.replica_name(index),
                                           drain):
                logger.warning("replica %d did not drain in time; its micro-batches will be "
                               "re-run", index)
            stop_replica(self._replicas.pop(index), self._groups.pop(index, None))
            self._record()
        finally:
            self._removing.discard(index)

    async def pending_groups(self) -> int:
        """How many of the replicas' placement groups wait for resources the cluster lacks."""
        return sum(group_pending(group) for group in self._groups.values())

    async def shutdown(self) -> None:
        """Kill every replica and remove its placement group (no drain: the pool is going)."""
        await self._adopted
        for index in sorted(self._replicas):
            stop_replica(self._replicas.pop(index), self._groups.pop(index, None))
        kv_delete(self._record_key)

    async def _adopt(self) -> None:
        """At creation, start the pool's first replicas (here, so the autoscaling loop never
        sees a pool still being filled). After a restart, the replicas its record names: a
        detached pool's outlive the controller and are adopted with their groups; a pool's that
        is not detached died with the previous controller, so as many new ones start (and the
        old groups go). The record, not the router, says which: both may have restarted."""
        if not ray.get_runtime_context().was_current_actor_reconstructed:
            for _ in range(self._config.initial_replicas):
                await self._start()
            self._record()  # also when it starts none: no earlier pool's record stays
            return
        record = json.loads(kv_get(self._record_key) or b'{"next_index": 0, "replicas": []}')
        self._next_index = record["next_index"]
        for index in record["replicas"]:
            handle, group = await asyncio.to_thread(self._look_up, index)
            if self._config.detached and handle is not None:
                self._replicas[index] = handle
                if group is not None:
                    self._groups[index] = group
            elif handle is not None or group is not None:
                stop_replica(handle, group)
        lost = len(record["replicas"]) - len(self._replicas)
        if lost:
            logger.warning("the controller restarted: starting %d replicas in place of those "
                           "that died with it", lost)
            for _ in range(lost):
                await self._start()
        self._record()

    def _look_up(self, index: int) -> tuple[ActorHandle | None, PlacementGroup | None]:
        """Replica `index` and its group, by the names this controller gave them (None: gone)."""
        try:
            handle = ray.get_actor(self._config.replica_name(index),
                                   namespace=self._config.namespace)
        except ValueError:
            handle = None
        try:
            group = ray.util.get_placement_group(self._config.placement_group_name(index))
        except ValueError:
            group = None
        return handle, group

    async def _call_router(self, method: str, *args):
        """Call the router, waiting out its restart: the methods called here are idempotent."""
        deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
        while True:
            try:
                return await getattr(self._router, method).remote(*args)
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ autoscaling

    async def _autoscale_forever(self) -> None:
        await self._adopted
        while True:
            try:
                await self._tick()
            except Exception:  # keep controlling whatever one round hit
                logger.exception("autoscaling round failed")
            await asyncio.sleep(self._config.autoscaling.interval_s)

    async def _tick(self) -> None:
        demand = await self._router.demand.remote()
        removing = {self._config.replica_name(i) for i in self._removing}
        failed = sorted(name for name, (state, _) in demand.replicas.items()
                        if state is ReplicaState.FAILED)
        supply = {name: (state, load) for name, (state, load) in demand.replicas.items()
                  if state not in (ReplicaState.DRAINING, ReplicaState.FAILED)
                  and name not in removing}
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
        direction = "up" if change > 0 else "down"
        logger.info("autoscaling %s from %d to %d replicas: %s", direction, len(supply),
                    decision.replicas, decision.reason)
        self._counts["scale_ups" if change > 0 else "scale_downs"] += 1
        self._metrics.decisions.inc(tags={**self._metrics.tags, "direction": direction})
        self._last = ScalingEvent(time.time(), len(supply), decision.replicas, decision.reason)
        for _ in range(change):
            await self.add_replica()
            self._counts["replicas_added"] += 1
        for index in self._removal_order(supply)[:max(-change, 0)]:
            self._removing.add(index)  # at once: this round's report counts it
            asyncio.get_event_loop().create_task(self._remove(index))

    def _removal_order(self, supply: Supply) -> list[int]:
        """Replicas that never got a node (or an engine) first, then the least loaded, newest
        first."""
        indices = {self._config.replica_name(i): i for i in self._replicas}
        names = sorted((n for n in supply if n in indices),
                       key=lambda n: (supply[n][0] is not ReplicaState.STARTING, supply[n][1],
                                      -indices[n]))
        return [indices[name] for name in names]

    async def _remove(self, index: int) -> None:
        try:
            await self._drain_and_stop(index)
            self._counts["replicas_removed"] += 1
        except Exception:
            logger.exception("removing replica %d failed", index)

    async def _report(self, demand_tokens: int, supply: Supply, failed: int) -> None:
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
