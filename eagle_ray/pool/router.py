"""The router actor: decides which replica serves each micro-batch; carries no tensor bytes.

A client asks for *leases* (`acquire_many`: every micro-batch it has waiting, in one call), calls
the named replicas itself, passes a lease from a finished micro-batch to its next one for a while
(`ClientConfig.lease_reuse_s`), and reports back in batches (`LeaseReport`s, carried by its next
`acquire_many` or sent with `release_many`), so the router handles a small fraction of a call per
micro-batch. Results therefore belong to the client, and a router restart loses none of them.
The router balances by outstanding *tokens* (micro-batches differ in length), caps them per
replica (backpressure), and keeps a registry of replicas that it rebuilds from the pool
controller's (their one owner, `pool/controller.py`) after a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import psutil
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.leases import GrantedLease, LeaseBook, take_back
from eagle_ray.pool.protocol import (
    AutoscalingReport,
    Demand,
    Grant,
    LeaseOwner,
    LeaseReport,
    LeaseRequest,
    NoReplicaAvailable,
    PoolStatus,
    Releases,
    ReplicaInfo,
    ReplicaStartupError,
    RouterProcess,
)
from eagle_ray.pool.replica_record import ReplicaRecord
from eagle_ray.pool.routing import choose_replica
from eagle_ray.pool.states import ReplicaState
from eagle_ray.pool.telemetry import RouterMetrics

logger = logging.getLogger(__name__)

DISCOVERY_PERIOD_S = 0.5
HEALTH_PERIOD_S = 2.0  # ready replicas are probed this often (restarts show as a new pid)
# A ready replica's probe runs beside its engine calls (its own concurrency group) and answers in
# milliseconds; one that does not answer this long is dead with its restart pending.
PROBE_TIMEOUT_S = 10.0


class PoolRouter:
    """Async Ray actor; see the module docstring. Created by `TargetPool`, named
    `<pool name>-router` in the pool's namespace."""

    def __init__(self, config: PoolConfig) -> None:
        self._config = config  # the pool's own (`pool_config`: what `TargetPool.connect` gets)
        self._namespace = config.namespace
        self._controller: ActorHandle | None = None  # looked up by name once it exists
        self._replicas: dict[str, ReplicaRecord] = {}  # name -> state
        self._removed: set[str] = set()  # names dropped on purpose; adoption skips them
        self._changed = asyncio.Condition()  # notified whenever capacity or membership changes
        self._leases = 0
        self._book = LeaseBook(config.lease_grace_s)  # leases granted, not handed back: whose
        self._taken_back = 0  # leases taken back from clients that died or went silent
        self._late_reports = 0  # reports on leases taken back (or granted before a restart)
        self._lease_calls = 0  # acquire_many + release_many calls (a fraction per lease)
        self._waiting_tokens = 0  # of lease requests waiting for room (part of the demand)
        self._autoscaling: AutoscalingReport | None = None  # the controller's last report
        self._last_health = 0.0  # monotonic time of the last probe of ready replicas
        self._metrics = RouterMetrics(config.name)
        self._discovery = asyncio.get_event_loop().create_task(self._discover_forever())

    # ------------------------------------------------------------------ membership

    async def pool_config(self) -> PoolConfig:  # what `TargetPool.connect` attaches with
        return self._config

    async def add_replica(self, index: int, handle: ActorHandle) -> None:
        """Called by the controller right after it starts a replica (and by adoption)."""
        name = self._config.replica_name(index)
        self._removed.discard(name)
        if name not in self._replicas:
            self._replicas[name] = ReplicaRecord(index, name, handle)
            self._probe_soon(self._replicas[name])

    async def remove_replica(self, name: str, drain: bool = True,
                             timeout_s: float = 600.0) -> bool:
        """Stop assigning to `name`; with `drain`, wait until its leases are released. Returns
        whether it drained fully; the controller kills the actor afterwards."""
        self._removed.add(name)
        replica = self._replicas.get(name)
        if replica is None:
            return True
        replica.state = ReplicaState.DRAINING
        drained = True
        if drain:
            deadline = time.monotonic() + timeout_s
            async with self._changed:
                while replica.outstanding_micro_batches > 0:
                    if not await self._wait_for_change(deadline):
                        drained = False
                        break
        self._replicas.pop(name, None)
        return drained

    async def _discover_forever(self) -> None:
        """Adopt the controller's replicas and probe the ones not ready."""
        while True:
            try:
                await self._adopt_members()
                health_round = time.monotonic() - self._last_health >= HEALTH_PERIOD_S
                for replica in self._replicas.values():
                    if replica.state in (ReplicaState.STARTING, ReplicaState.SUSPECT) \
                            or health_round:
                        self._probe_soon(replica)
                if health_round:
                    self._last_health = time.monotonic()
                await self._take_back_leases()
                self._metrics.states([r.state for r in self._replicas.values()])
            except Exception:  # keep discovering whatever one round hit
                logger.exception("replica discovery failed")
            await asyncio.sleep(DISCOVERY_PERIOD_S)

    async def _adopt_members(self) -> None:
        """The controller's replicas are the pool's: adopt the ones this router lacks, drop the
        ones the controller no longer has (unless draining: their removal is under way)."""
        try:
            self._controller = self._controller or await asyncio.to_thread(
                ray.get_actor, self._config.controller_name, namespace=self._namespace)
            members = await self._controller.members.remote()
        except (ValueError, RayActorError):  # not created yet, or restarting: next round
            return
        for index, handle in sorted(members.items()):
            if self._config.replica_name(index) not in self._removed:
                await self.add_replica(index, handle)
        for name, replica in list(self._replicas.items()):
            if replica.index in members:
                replica.owned = True
            elif replica.owned and replica.state is not ReplicaState.DRAINING:
                logger.warning("replica %s is gone; dropping it", name)
                self._replicas.pop(name)

    def _probe_soon(self, replica: ReplicaRecord) -> None:
        if not replica.probing:
            replica.probing = True
            asyncio.get_event_loop().create_task(self._probe(replica))

    async def _probe(self, replica: ReplicaRecord) -> None:
        """Wait for a replica's `ready()`; a new pid means the actor was restarted."""
        answer = asyncio.ensure_future(replica.handle.ready.remote())
        try:
            answered, _ = await asyncio.wait({answer}, timeout=PROBE_TIMEOUT_S)
            if not answered and replica.state is ReplicaState.READY:
                # Died while idle and Ray's restart is pending (calls to it would wait for it):
                # no leases until it answers.
                logger.warning("replica %s did not answer its probe in %.0fs; suspect until it "
                               "does", replica.name, PROBE_TIMEOUT_S)
                replica.state = ReplicaState.SUSPECT
            info = await answer
        except Exception as e:  # dead or restarting: probe again next round
            logger.info("replica %s not ready: %s", replica.name, type(e).__name__)
            if replica.state is ReplicaState.READY:
                replica.state = ReplicaState.SUSPECT
            return
        finally:
            replica.probing = False
        if replica.pid is not None and info.pid != replica.pid:
            replica.restarts += 1
            self._metrics.restarts.inc(tags=self._metrics.replica(replica.name))
        replica.info = info
        self._metrics.engine(replica.name, info.engine)
        if replica.state is ReplicaState.FAILED:
            return  # it stays so (the health rounds probe it like the others)
        if info.startup_error is not None:  # its backend could not be built: no leases, no
            replica.state = ReplicaState.FAILED  # retries
            logger.error("replica %s failed to start: %s", replica.name, info.startup_error)
        elif replica.state in (ReplicaState.STARTING, ReplicaState.SUSPECT):
            replica.state = ReplicaState.READY
            logger.info("replica %s ready (pid %s, node %s)", replica.name, replica.pid,
                        replica.node_id)
        else:
            return
        async with self._changed:  # wakes lease requests, and waits that fail on FAILED
            self._changed.notify_all()

    # ------------------------------------------------------------------ leases

    async def acquire(self, micro_batch_id: int, num_tokens: int, avoid: list[str],
                      timeout_s: float, client_node: str | None = None) -> Grant:
        """Lease a replica for one micro-batch (`acquire_many` with one request)."""
        grants = await self.acquire_many([(micro_batch_id, num_tokens, avoid)], timeout_s,
                                         client_node)
        return grants[0]

    async def acquire_many(self, requests: list[LeaseRequest], timeout_s: float,
                           client_node: str | None = None, releases: Releases = (),
                           owner: LeaseOwner | None = None) -> list[Grant | None]:
        """Leases for a client's waiting micro-batches `(id, tokens, replicas to avoid)`, in one
        call: waits (backpressure, up to `timeout_s`) until the first can be granted, then grants
        every other one that fits now; None for the rest (the client asks again). Each is chosen
        by `routing.choose_replica`, preferring `client_node` when locality is on. `releases`: the
        client's finished leases since its last call (`release_many`'s reports), applied first,
        so one call per client round carries both. `owner`: the client, whose leases go back
        when it dies or falls silent (`pool/leases.py`)."""
        started = time.monotonic()
        self._lease_calls += 1
        waiting = sum(tokens for _, tokens, _ in requests)
        grants: list[Grant | None] = []
        for report in releases:
            self._release(report)
        async with self._changed:
            if releases:
                self._changed.notify_all()
            self._waiting_tokens += waiting
            try:
                grants.append(await self._grant(*requests[0], timeout_s, client_node,
                                                started, owner))
                grants += [self._try_grant(tokens, avoid, client_node, owner, started)
                           for _, tokens, avoid in requests[1:]]
                return grants
            finally:
                self._waiting_tokens -= waiting
                for _ in range(max(1, sum(g is not None for g in grants))):  # per lease
                    self._metrics.lease_wait.observe(time.monotonic() - started,
                                                     tags={"pool": self._metrics.pool})

    async def _grant(self, micro_batch_id: int, num_tokens: int, avoid: list[str],
                     timeout_s: float, client_node: str | None,
                     started: float, owner: LeaseOwner | None) -> Grant:
        """Wait (holding `self._changed`) for a replica with room for one micro-batch."""
        while True:
            grant = self._try_grant(num_tokens, avoid, client_node, owner, started)
            if grant is not None:
                return grant
            self._raise_if_all_failed()
            if not await self._wait_for_change(started + timeout_s):
                raise NoReplicaAvailable(
                    f"no replica accepted micro-batch {micro_batch_id} ({num_tokens} tokens) "
                    f"within {timeout_s:.0f}s; replicas: "
                    f"{ {n: r.state.value for n, r in self._replicas.items()} or 'none'}"
                    f"{'; already failed on ' + str(sorted(avoid)) if avoid else ''}"
                )

    def _try_grant(self, num_tokens: int, avoid: list[str], client_node: str | None,
                   owner: LeaseOwner | None, asked: float) -> Grant | None:
        """Lease the replica the policy chooses now, or None when none has room. The grant says
        how long after the request arrived (`asked`) its term starts (`Grant`)."""
        cap = self._config.max_outstanding_tokens_per_replica
        replica = choose_replica(self._replicas.values(), num_tokens, set(avoid), cap,
                                 client_node if self._config.locality else None)
        if replica is None:
            return None
        replica.outstanding_tokens += num_tokens
        replica.outstanding_micro_batches += 1
        replica.leases += 1
        if client_node is not None and client_node == replica.node_id:
            replica.on_node_leases += 1
        replica.peak_outstanding_tokens = max(replica.peak_outstanding_tokens,
                                              replica.outstanding_tokens)
        self._leases += 1
        self._metrics.outstanding.set(replica.outstanding_tokens,
                                      tags=self._metrics.replica(replica.name))
        now = time.monotonic()
        lease_id = self._book.grant(replica.name, num_tokens, owner, now)
        return replica.name, replica.actor_id, lease_id, now - asked

    async def _wait_for_change(self, deadline: float) -> bool:
        """Wait (holding `self._changed`) for a capacity or membership change, at most a second
        at a time so deadlines are honoured; False once `deadline` has passed."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        except TimeoutError:
            pass
        return True

    async def release(self, grant: Grant, num_tokens: int, ok: bool,
                      replica_died: bool = False) -> None:
        """A leased micro-batch finished, failed or timed out, and its lease is handed back."""
        name, _, lease_id, _ = grant
        await self.release_many([LeaseReport(name, num_tokens, ok, replica_died, num_tokens,
                                             lease_id)])

    async def release_many(self, reports: Releases) -> None:
        """A client's `LeaseReport`s since its last call, in one call."""
        self._lease_calls += 1
        for report in reports:
            self._release(report)
        async with self._changed:
            self._changed.notify_all()

    def _release(self, report: LeaseReport) -> None:
        name = report.replica
        if report.returned_tokens is None:
            held = self._book.heard(report.lease_id, time.monotonic())
        else:
            lease = self._book.give_back(report.lease_id)
            held = lease is not None
            if held:
                self._return(lease)
        if not held:  # taken back before: its tokens came back then, its outcome counts now
            self._late_reports += 1
        replica = self._replicas.get(name)
        if replica is None:
            return
        if report.ok:
            replica.served_tokens += report.served_tokens
            replica.served_micro_batches += 1
            replica.first_served_at = replica.first_served_at or time.monotonic()
            self._metrics.served.inc(report.served_tokens, tags=self._metrics.replica(name))
        elif report.ok is False:
            replica.errors += 1
            self._metrics.errors.inc(tags=self._metrics.replica(name))
            if report.replica_died and replica.state is ReplicaState.READY:
                replica.state = ReplicaState.SUSPECT
                self._probe_soon(replica)

    def _return(self, lease: GrantedLease) -> None:
        """A lease's tokens are no longer outstanding on its replica."""
        replica = self._replicas.get(lease.replica)
        if replica is None:
            return
        replica.outstanding_tokens = max(0, replica.outstanding_tokens - lease.tokens)
        replica.outstanding_micro_batches = max(0, replica.outstanding_micro_batches - 1)
        self._metrics.outstanding.set(replica.outstanding_tokens,
                                      tags=self._metrics.replica(lease.replica))

    async def _take_back_leases(self) -> None:
        """Leases of clients gone or silent past their term go back to their replicas."""
        taken = await take_back(self._book, time.monotonic())
        if not taken:
            return
        for lease in taken:
            self._return(lease)
        self._taken_back += len(taken)
        logger.warning("took back %d lease(s) (%d tokens) from clients that died or went silent",
                       len(taken), sum(lease.tokens for lease in taken))
        async with self._changed:
            self._changed.notify_all()

    # ------------------------------------------------------------------ status

    async def demand(self) -> Demand:
        """What the autoscaling controller reads: tokens leased and waiting, and each replica's
        state and load (`pool/autoscaling.py`)."""
        return Demand(self._demand_tokens(), self._waiting_tokens,
                      {name: (r.state, r.outstanding_tokens)
                       for name, r in self._replicas.items()})

    def _demand_tokens(self) -> int:
        return sum(r.outstanding_tokens for r in self._replicas.values()) + self._waiting_tokens

    async def report_autoscaling(self, report: AutoscalingReport) -> None:
        """The controller's latest decision and counts, shown in `status()`."""
        self._autoscaling = report

    async def status(self) -> PoolStatus:
        """Per replica: state, outstanding tokens, tokens/s, on-node share, errors, restarts;
        plus totals."""
        replicas = self._replicas.values()
        leases = sum(r.leases for r in replicas)
        return PoolStatus(
            replicas={name: r.summary() for name, r in sorted(self._replicas.items())},
            ready_replicas=sum(r.state is ReplicaState.READY for r in replicas),
            leases=self._leases, lease_calls=self._lease_calls, leases_taken_back=self._taken_back,
            late_reports=self._late_reports, leases_held=len(self._book),
            locality=self._config.locality,
            on_node_share=round(sum(r.on_node_leases for r in replicas) / leases, 3)
            if leases else None,
            demand_tokens=self._demand_tokens(), autoscaling=self._autoscaling,
            router=RouterProcess(os.getpid(), psutil.Process().memory_info().rss))

    async def target_info(self, timeout_s: float = 600.0) -> ReplicaInfo:
        """What a client validates against (vocabulary, max length), from a ready replica."""
        deadline = time.monotonic() + timeout_s
        async with self._changed:
            while True:
                for replica in self._replicas.values():
                    if replica.state is ReplicaState.READY and replica.info is not None:
                        return replica.info
                self._raise_if_all_failed()
                if not await self._wait_for_change(deadline):
                    raise NoReplicaAvailable(f"no replica became ready within {timeout_s:.0f}s")

    def _raise_if_all_failed(self) -> None:
        """Nothing to wait for once every replica failed to start: say why, now."""
        errors = {name: r.info.startup_error for name, r in self._replicas.items()
                  if r.state is ReplicaState.FAILED and r.info is not None}
        if errors and len(errors) == len(self._replicas):
            raise ReplicaStartupError.of(self._metrics.pool, errors, len(self._replicas))

