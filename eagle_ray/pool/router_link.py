"""A client's side of the router: leases asked for, passed on and reported in batches.

Every micro-batch waiting for a replica is asked for in one `acquire_many` per client round. A
lease whose micro-batch finished well passes to the client's next waiting micro-batch that fits
it, with no router call, until `ClientConfig.lease_reuse_s` after its grant; then, or when no
micro-batch waits for it, it goes back. What happened on each lease (`LeaseReport`) rides on the
next `acquire_many`, or is sent with `release_many` when a lease goes back or every
`REPORT_INTERVAL_S`. In steady streaming the router sees about one call per lease (the client's
window) per `lease_reuse_s`, not one per micro-batch. Also finds the router by name (again,
after it restarts) and the granted replicas by name (once per actor).

A lease is dated from the client's request plus the router's wait (`Grant`), so the client knows,
on its own clock, from when the router may have taken it back (`Lease.lapses`: its term plus the
router's `lease_grace_s`). A client that was away that long (a stall: a GC pause, a checkpoint
write, a stopped process) runs nothing more on it: a grant read that late goes back unused, and
an attempt on it still running is re-run on a fresh lease (`PoolClient`); neither charges the
replica. Their reports reach the router late and count once (`pool/leases.py`).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Sequence

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.pool.inflight import InFlightMicroBatch
from eagle_ray.pool.protocol import (
    ClientStats,
    Grant,
    Lease,
    LeaseOwner,
    LeaseReport,
    LeaseRequest,
    NoReplicaAvailable,
    ReplicaInfo,
)

logger = logging.getLogger(__name__)

ROUTER_RETRY_S = 0.5  # pause before asking a restarting router again
REPORT_INTERVAL_S = 0.5  # outcomes on leases still in use reach the router at least this often


class RouterUnavailable(RuntimeError):
    """The router stayed unreachable for the whole lease timeout."""


class RouterLink:
    """See the module docstring. `connect` builds one; the client owns it."""

    def __init__(self, router: ActorHandle, router_name: str | None, namespace: str | None,
                 node_id: str, lease_reuse_s: float = 0.0, term_s: float = 600.0,
                 grace_s: float = math.inf) -> None:
        self.router, self.router_name, self.namespace = router, router_name, namespace
        self.node_id = node_id  # sent with every request, for locality-aware leases
        self.lease_reuse_s = lease_reuse_s
        self.attempt_s = term_s - lease_reuse_s  # one attempt's timeout
        self.lapse_s = term_s + grace_s  # after a lease's grant the router may take it back
        self.stats = ClientStats()  # the client's (it counts lapsed leases)
        # Who holds this client's leases: an object this process owns, which the router reads
        # to learn that the process is gone (its leases then go back), and how long a lease
        # may go unreported (`pool/leases.py`).
        key = uuid.uuid4().hex[:12]
        self.owner = LeaseOwner(key, [ray.put(key)], term_s)
        self._reports: list[LeaseReport] = []
        self._spares: list[Lease] = []  # leases free since their micro-batch finished
        self._last_sent = time.monotonic()
        self._replicas: dict[str, tuple[str, ActorHandle]] = {}  # name -> (actor id, handle)

    @classmethod
    def connect(cls, pool_name: str, namespace: str, config: ClientConfig
                ) -> tuple[RouterLink, ReplicaInfo, int]:
        """`(link, what a replica reported, times the router was unavailable)`, waiting for a
        restarting router up to `config.lease_timeout_s`."""
        router_name = PoolConfig(name=pool_name, namespace=namespace).router_name
        deadline = time.monotonic() + config.lease_timeout_s
        unavailable = 0
        while True:
            try:
                router = ray.get_actor(router_name, namespace=namespace)
            except ValueError:
                raise ValueError(f"no eagle_ray pool named {pool_name!r} in namespace "
                                 f"{namespace!r}; start one with `eagle-ray serve` or "
                                 f"TargetPool.create") from None
            try:
                info, pool = ray.get([router.target_info.remote(config.lease_timeout_s),
                                      router.pool_config.remote()],
                                     timeout=max(deadline - time.monotonic(), 1.0))
                break
            except RayActorError as e:  # the router is restarting: wait for it
                unavailable += 1
                if time.monotonic() > deadline:
                    raise RouterUnavailable(f"the router of pool {pool_name!r} stayed "
                                            f"unavailable for {config.lease_timeout_s:.0f}s: "
                                            f"{e}") from e
                logger.warning("router of pool %r unavailable (%s); retrying", pool_name,
                               type(e).__name__)
                time.sleep(ROUTER_RETRY_S)
        link = cls(router, router_name, namespace, ray.get_runtime_context().get_node_id(),
                   config.lease_reuse_s, config.timeout_s + config.lease_reuse_s,
                   pool.lease_grace_s)
        return link, info, unavailable

    def lease(self, grant: Grant, tokens: int, asked_at: float) -> Lease:
        """The lease the router granted for a micro-batch of `tokens` asked for at `asked_at`:
        its term started no earlier than that plus the router's wait."""
        name, actor_id, lease_id, waited_s = grant
        since = asked_at + waited_s
        return Lease(name, actor_id, lease_id, tokens, since + self.lease_reuse_s,
                     since + self.lapse_s)

    def usable(self, lease: Lease) -> bool:
        """Whether an attempt starting now on `lease` ends (its timeout) before the router may
        take the lease back. A spare before `expires` always is."""
        return time.monotonic() + self.attempt_s < lease.lapses

    def lapsed(self, lease: Lease) -> None:
        """Hand back a lease the router may have taken back while this client was away (a
        stall past its term): its report is late there and counts once."""
        logger.warning("lease %d on %s (granted %.1fs ago) is past what this client may run "
                       "on it: it was away (a stall?) and the router may take it back; handing "
                       "it back, its micro-batch runs on a fresh one", lease.lease_id,
                       lease.replica, time.monotonic() - lease.lapses + self.lapse_s)
        self.stats.lapsed_leases += 1
        self._reports.append(LeaseReport(lease.replica, 0, None, False, lease.tokens,
                                         lease.lease_id))

    def ask(self, items: Sequence[InFlightMicroBatch], timeout_s: float
            ) -> list[tuple[InFlightMicroBatch, Lease]]:
        """Spare leases for the `items` they fit (returned), and one `acquire_many` for the rest,
        carrying every report and the spares left over; each asked item keeps the shared answer's
        ref (`lease_ref`)."""
        matched, asked = [], []
        for item in items:
            lease = self._take_spare(item.num_tokens, item.failed_on)
            if lease is None:
                asked.append(item)
            else:
                matched.append((item, lease))
        if asked:
            self._give_back(self._spares)
            reports, self._reports = self._reports, []
            self._last_sent = time.monotonic()
            ref = self.router.acquire_many.remote(
                [LeaseRequest(i.micro_batch_id, i.num_tokens, i.failed_on) for i in asked],
                timeout_s, self.node_id, reports, self.owner)
            for item in asked:
                item.lease_ref, item.asked_at = ref, self._last_sent
        return matched

    def granted(self, ref: ray.ObjectRef, items: Sequence[InFlightMicroBatch]
                ) -> list[tuple[InFlightMicroBatch, Lease]] | None:
        """The leases an `acquire_many` answer (`ref`, from `ask`) granted to `items` that are
        still `usable` (one read only after a stall goes back: `lapsed`); the others ask again.
        None when the router was unreachable: it is looked up again, and the caller asks again
        shortly. Raises `NoReplicaAvailable` when none took the first in time."""
        try:
            grants = ray.get(ref)
        except RayActorError:
            logger.warning("router unreachable; retrying leases for %d micro-batch(es)",
                           len(items))
            self.reconnect()
            return None
        except RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, NoReplicaAvailable):
                raise cause from None
            raise
        leased = [(item, self.lease(grant, item.num_tokens, item.asked_at))
                  for item, grant in zip(items, grants, strict=True) if grant is not None]
        usable = [self.usable(lease) for _, lease in leased]
        for (_, lease), ok in zip(leased, usable, strict=True):
            if not ok:
                self.lapsed(lease)
        return [pair for pair, ok in zip(leased, usable, strict=True) if ok]

    def _take_spare(self, tokens: int, avoid: list[str]) -> Lease | None:
        """The smallest unexpired spare lease with room for `tokens`, on a replica not in
        `avoid`."""
        now = time.monotonic()
        fits = [lease for lease in self._spares if lease.tokens >= tokens
                and lease.expires > now and lease.replica not in avoid]
        if not fits:
            return None
        lease = min(fits, key=lambda lease: lease.tokens)
        self._spares.remove(lease)
        return lease

    def finish(self, lease: Lease, tokens: int, ok: bool, replica_died: bool = False) -> None:
        """A micro-batch of `tokens` ended on `lease`: a success keeps it (spare) until it
        expires; a failure hands it back."""
        keep = ok and time.monotonic() < lease.expires
        self._reports.append(LeaseReport(lease.replica, tokens, ok, replica_died,
                                         None if keep else lease.tokens, lease.lease_id))
        if keep:
            self._spares.append(lease)

    def _give_back(self, leases: list[Lease]) -> None:
        for lease in list(leases):
            self._reports.append(LeaseReport(lease.replica, 0, None, False, lease.tokens,
                                             lease.lease_id))
            self._spares.remove(lease)

    def replica(self, name: str, actor_id: str) -> ActorHandle:
        """The handle of a granted replica. Raises ValueError when no actor has that name now
        (removed since the grant)."""
        known = self._replicas.get(name)
        if known is None or known[0] != actor_id:  # first grant, or a new actor of that name
            known = self._replicas[name] = (actor_id,
                                            ray.get_actor(name, namespace=self.namespace))
        return known[1]

    def settle(self, keep: int | None = None) -> None:
        """Hand back expired spares and all but `keep` of the others (None: all of them; the
        client will pass them on to micro-batches it is about to queue), and send the reports
        when a lease went back or `REPORT_INTERVAL_S` has passed."""
        now = time.monotonic()
        live = [lease for lease in self._spares if lease.expires > now]
        self._give_back([lease for lease in self._spares if lease.expires <= now]
                        + live[len(live) if keep is None else keep:])
        if any(r.returned_tokens is not None for r in self._reports) \
                or now - self._last_sent >= REPORT_INTERVAL_S:
            self.flush(keep_spares=True)

    def flush(self, keep_spares: bool = False) -> None:
        """Send every report now in one call, handing back the spares first (the client may not
        call again soon)."""
        if not keep_spares:
            self._give_back(self._spares)
        if self._reports:
            reports, self._reports = self._reports, []
            self._last_sent = time.monotonic()
            try:
                self.router.release_many.remote(reports)
            except RayActorError:
                pass  # a restarted router starts counting afresh

    def reconnect(self) -> None:
        """Look the router up again by name (after it restarted or was replaced)."""
        if self.router_name is None:
            return
        try:
            self.router = ray.get_actor(self.router_name, namespace=self.namespace)
        except ValueError:
            pass  # not back yet
