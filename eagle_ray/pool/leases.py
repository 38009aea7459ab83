"""The router's book of granted leases: which client holds what on which replica, until when.

Only a client hands its leases back, so a client that dies holding some (a preempted Ray Train
worker, an OOM-killed trainer) would leave their tokens outstanding forever: routing would see
those replicas as loaded, the autoscaler would never scale down, and a drain would wait for its
whole timeout. So every grant is written here with its owner and a term; the router takes a
lease back when its owner's process is gone (it asks Ray: `LeaseOwner.alive`) or when the lease
went unreported past its term plus a grace (`PoolConfig.lease_grace_s`). A client that was only
stalled (a GC pause, a checkpoint write, a stopped process) comes back to leases taken back: its
reports on them are late, and a late report returns no tokens (they were returned when the
lease was taken back). Lease ids carry a generation drawn for each book, so a report on a lease
granted by a router before it restarted is late too, never taken for a new lease of the same
number. `LeaseBook` is pure bookkeeping (the clock is passed in, so it is tested without a
cluster); `owner_gone` is the one question put to Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import random

import ray

from eagle_ray.pool.protocol import LeaseOwner

logger = logging.getLogger(__name__)

GRACE_S = 30.0  # beyond a lease's term before the router takes it back (PoolConfig's default)
ANONYMOUS_TERM_S = 600.0  # the term of a lease asked for without an owner (probes, tools)
OWNER_CHECK_S = 1.0  # a client's liveness object answers in milliseconds while it lives


@dataclasses.dataclass
class GrantedLease:
    """One granted lease: where, how many tokens, whose, and when it is taken back."""

    replica: str
    tokens: int
    owner: str | None
    expires: float  # monotonic seconds


class LeaseBook:
    """Granted leases by id, and their owners (a key and what the router checks them by)."""

    def __init__(self, grace_s: float = GRACE_S) -> None:
        self.grace_s = grace_s  # beyond a lease's term before it is taken back
        # This book's generation in the ids' high bits: a restarted router's ids are not its
        # predecessor's, so an old lease's late report cannot return a new lease's tokens.
        self._ids = itertools.count(random.getrandbits(31) << 32)
        self._leases: dict[int, GrantedLease] = {}
        self._owners: dict[str, LeaseOwner] = {}

    def grant(self, replica: str, tokens: int, owner: LeaseOwner | None, now: float) -> int:
        """Record a lease; its id."""
        if owner is not None:
            self._owners.setdefault(owner.key, owner)
        lease_id = next(self._ids)
        self._leases[lease_id] = GrantedLease(replica, tokens, owner and owner.key,
                                              now + self._term(owner and owner.key))
        return lease_id

    def heard(self, lease_id: int, now: float) -> bool:
        """The owner reported on the lease and keeps it: its term starts again. False when the
        lease was taken back before (a late report)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.expires = now + self._term(lease.owner)
        return lease is not None

    def give_back(self, lease_id: int) -> GrantedLease | None:
        """The owner handed the lease back; None when it was taken back before (or granted by a
        router before a restart): its tokens are no longer counted."""
        return self._leases.pop(lease_id, None)

    def expired(self, now: float) -> list[GrantedLease]:
        """Take back every lease silent past its term."""
        return self._take_back([i for i, lease in self._leases.items() if lease.expires <= now])

    def owners(self) -> list[LeaseOwner]:
        """Owners holding leases now (whose liveness is worth asking Ray about)."""
        holding = {lease.owner for lease in self._leases.values()}
        for key in set(self._owners) - holding:  # nothing left to take back from them
            del self._owners[key]
        return list(self._owners.values())

    def owner_gone(self, key: str) -> list[GrantedLease]:
        """Take back every lease of an owner whose process is gone."""
        self._owners.pop(key, None)
        return self._take_back([i for i, lease in self._leases.items() if lease.owner == key])

    def __len__(self) -> int:
        return len(self._leases)

    def _term(self, owner: str | None) -> float:
        known = self._owners.get(owner) if owner is not None else None
        return (known.term_s if known is not None else ANONYMOUS_TERM_S) + self.grace_s

    def _take_back(self, ids: list[int]) -> list[GrantedLease]:
        return [self._leases.pop(i) for i in ids]


async def take_back(book: LeaseBook, now: float) -> list[GrantedLease]:
    """Every lease silent past its term, and every lease of an owner whose process is gone
    (Ray says so when the router reads the object the owner put), out of `book`."""
    taken = book.expired(now)
    owners = book.owners()
    gone = await asyncio.gather(*(owner_gone(owner) for owner in owners))
    for owner, dead in zip(owners, gone, strict=True):
        if dead:
            taken += book.owner_gone(owner.key)
            logger.warning("client %s is gone; taking its leases back", owner.key)
    return taken


async def owner_gone(owner: LeaseOwner) -> bool:
    """Whether the client behind `owner` is gone: reading the object it owns fails with
    `OwnerDiedError` once its process is (a read that only times out says nothing)."""
    try:
        await asyncio.wait_for(asyncio.wrap_future(owner.alive[0].future()), OWNER_CHECK_S)
    except ray.exceptions.ObjectLostError:  # OwnerDiedError among them
        return True
    except Exception:  # noqa: BLE001 -- slow or unknown: alive until its term says otherwise
        return False
    return False
