"""The pool controller: the one owner of a pool's replicas, and its autoscaler.

Every replica is started, drained and stopped here (`add_replica`, `remove_replica`,
`shutdown`): the controller reserves an index (in its record first) and a placement group, starts
the actor and registers it with the router; removing one asks the router to drain it, then kills
the actor and removes its group. `TargetPool` (a person's or a job's calls) and the autoscaling
loop both go through it, so membership has one source of truth: the router adopts the
controller's replicas (after a router restart too), and a restarted controller reads which
replicas the pool had from its record in Ray's key-value store (in the GCS, which outlives both
actors), looks each up by the name it gave it and adopts it; only those gone start anew. Nothing
lists the cluster.

Replicas and the controller are detached actors in every pool, so neither's death takes the
other down (Ray ends an actor with its owner: owned replicas would die with a controller that
restarts, and every engine with them). The pool's life is its router's: the router is owned by
the pool's creator (detached only when the pool is), so it ends with the creator's job; the
controller watches it and, once it is gone for good, removes the replicas and their groups and
ends itself (`_follow_the_router`). The controller finds the router by name rather than taking
its handle: a non-detached actor's handle among a restartable actor's constructor arguments is
what Ray reports, with an error line at every start, as arguments in the object store.

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
import warnings

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
LIFELINE_PERIOD_S = 1.0  # how often the controller checks that its pool's router still exists
GONE_WAIT_S = 30.0  # how long an ending controller waits for its replicas' names to be free


class RouterGone(RuntimeError):
    """The pool's router no longer exists: the pool's creator ended, or it was shut down."""


class PoolController:
    """Async, detached Ray actor named `<pool name>-controller`, created by `TargetPool.create`
    after the router (which it looks up by name)."""

    def __init__(self, config: PoolConfig) -> None:
        logging.basicConfig(level=logging.INFO)
        self._config = config
        self._router: ActorHandle | None = None  # looked up by name (`_router_actor`)
        self._replicas: dict[int, ActorHandle] = {}  # the pool's replicas (detached actors)
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
        self._task: asyncio.Task | None = None
        if self._policy is not None:
            self._task = asyncio.get_event_loop().create_task(self._autoscale_forever())
        self._lifeline = asyncio.get_event_loop().create_task(self._follow_the_router())

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
        # Recorded before it exists: a controller that dies while starting it leaves no replica
        # its successor does not know of (it adopts it, or replaces it when it never started).
        self._record(starting=index)
        self._replicas[index], self._groups[index] = start_replica(self._config, index)
        await self._call_router("add_replica", index, self._replicas[index])
        return index

    def _record(self, starting: int | None = None) -> None:
        """Write which replicas the pool has where a restarted controller finds them."""
        indices = set(self._replicas) | ({starting} if starting is not None else set())
        kv_put(self._record_key, json.dumps({"next_index": self._next_index,
                                             "replicas": sorted(indices)}).encode())

    def _read_record(self) -> dict:
        return json.loads(kv_get(self._record_key) or b'{"next_index": 0, "replicas": []}')

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
        await asyncio.wait([self._adopted])  # done, whether it started every replica or not
        await self._remove_everything()

    async def _adopt(self) -> None:
        """At creation, start the pool's first replicas (here, so the autoscaling loop never
        sees a pool still being filled). After a restart, adopt the replicas its record names
        with their groups: they are detached and outlive the controller, engines and all. One
        gone meanwhile (killed for good, or never started) is dropped from the router and
        replaced. The record, not the router, says which: both may have restarted."""
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one of its own
            warnings.simplefilter("ignore", DeprecationWarning)
            restarted = ray.get_runtime_context().was_current_actor_reconstructed
        if not restarted:
            for _ in range(self._config.initial_replicas):
                await self._start()
            self._record()  # also when it starts none: no earlier pool's record stays
            return
        record = self._read_record()
        self._next_index = record["next_index"]
        lost = []
        for index in record["replicas"]:
            handle, group = await asyncio.to_thread(self._look_up, index)
            if handle is None:
                stop_replica(None, group)
                lost.append(index)
                continue
            self._replicas[index] = handle
            if group is not None:
                self._groups[index] = group
        self._record()
        logger.info("the controller restarted: adopted replicas %s", sorted(self._replicas))
        if lost:
            logger.warning("replicas %s are gone; starting %d in their place", lost, len(lost))
            for index in lost:  # the router may still list them (it adopts, never looks up)
                await self._call_router("remove_replica", self._config.replica_name(index),
                                        False)
            for _ in lost:
                await self._start()

    def _replica(self, index: int) -> ActorHandle | None:
        """Replica `index` by the name this controller gave it (None: gone for good)."""
        try:
            return ray.get_actor(self._config.replica_name(index),
                                 namespace=self._config.namespace)
        except ValueError:
            return None

    def _look_up(self, index: int) -> tuple[ActorHandle | None, PlacementGroup | None]:
        """Replica `index` and its group, by the names this controller gave them (None: gone)."""
        handle = self._replica(index)
        try:
            group = ray.util.get_placement_group(self._config.placement_group_name(index))
        except ValueError:
            group = None
        return handle, group

    async def _router_actor(self) -> ActorHandle:
        """The pool's router, looked up by name once (its handle stays valid across its
        restarts). Raises `RouterGone` when it no longer exists."""
        if self._router is None:
            try:
                self._router = await asyncio.to_thread(
                    ray.get_actor, self._config.router_name, namespace=self._config.namespace)
            except ValueError:
                raise RouterGone(f"the router {self._config.router_name} is gone") from None
        return self._router

    async def _router_gone(self) -> bool:
        """Whether the router is gone for good: its name goes with it (not while it restarts)."""
        try:
            await asyncio.to_thread(ray.get_actor, self._config.router_name,
                                    namespace=self._config.namespace)
        except ValueError:
            return True
        return False

    async def _call_router(self, method: str, *args):
        """Call the router, waiting out its restart: the methods called here are idempotent."""
        deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
        while True:
            try:
                return await getattr(await self._router_actor(), method).remote(*args)
            except RayActorError:
                if time.monotonic() > deadline or await self._router_gone():
                    raise
                await asyncio.sleep(0.5)

    # ------------------------------------------------------------------ the pool's end

    async def _follow_the_router(self) -> None:
        """The pool lives as long as its router, which ends with the pool's creator (a job's
        driver; nothing, for a detached pool) or `TargetPool.shutdown`. Once it is gone, remove
        what the pool holds on the cluster and end: the replicas are detached, so nothing else
        would."""
        while True:
            try:
                if await self._router_gone():
                    break
            except Exception:  # the GCS did not answer: no news about the router
                logger.exception("looking up the router failed")
            await asyncio.sleep(LIFELINE_PERIOD_S)
        logger.warning("pool %s: its router is gone (its creator ended); removing its replicas",
                       self._config.name)
        for task in (self._adopted, self._task):
            if task is not None:
                task.cancel()
        await self._remove_everything()
        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)

    async def _remove_everything(self) -> None:
        """Kill every replica the record or this controller knows, remove their groups and the
        record, and wait (a while) until their names are free for a pool of the same name."""
        indices = sorted(set(self._read_record()["replicas"]) | set(self._replicas))
        for index in indices:
            handle, group = await asyncio.to_thread(self._look_up, index)
            stop_replica(handle or self._replicas.pop(index, None),
                         group or self._groups.pop(index, None))
        self._replicas.clear()
        self._groups.clear()
        kv_delete(self._record_key)
        deadline = time.monotonic() + GONE_WAIT_S
        while time.monotonic() < deadline:
            if not any([await asyncio.to_thread(self._replica, i) for i in indices]):
                return
            await asyncio.sleep(0.2)
        logger.warning("replicas of pool %s still listed after %.0fs", self._config.name,
                       GONE_WAIT_S)

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
        demand = await (await self._router_actor()).demand.remote()
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
        await (await self._router_actor()).report_autoscaling.remote(AutoscalingReport(
            min_replicas=cfg.min_replicas, max_replicas=cfg.max_replicas,
            target_outstanding_tokens_per_replica=cfg.target_outstanding_tokens_per_replica,
            **counts, replicas=len(supply), removing=len(self._removing), **self._counts,
            last_decision=self._last, blocked=self._blocked, rounds=self._rounds))
