"""The router's book of granted leases: which client holds what on which replica, until when.

Only a client hands its leases back, so a client that dies holding some (a preempted Ray Train
worker, an OOM-killed trainer) would leave their tokens outstanding forever: routing would see
those replicas as loaded, the autoscaler would never scale down, and a drain would wait for its
whole timeout. So every grant is written here with its owner and a term; the router takes a
lease back when its owner's process is gone (it asks Ray: `LeaseOwner.alive`) or when the lease
went unreported past its term plus `GRACE_S`. A report on a lease taken back counts nothing.
`LeaseBook` is pure bookkeeping (the clock is passed in, so it is tested without a cluster);
`owner_gone` is the one question put to Ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import ray

from eagle_ray.pool.protocol import LeaseOwner

GRACE_S = 30.0  # beyond a lease's term before the router takes it back
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

    def __init__(self) -> None:
        self._ids = itertools.count()
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

    def heard(self, lease_id: int, now: float) -> None:
        """The owner reported on the lease and keeps it: its term starts again."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.expires = now + self._term(lease.owner)

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
        return (known.term_s if known is not None else ANONYMOUS_TERM_S) + GRACE_S

    def _take_back(self, ids: list[int]) -> list[GrantedLease]:
        return [self._leases.pop(i) for i in ids]


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
