"""What the router and its callers hand each other: leases, lease reports, and the errors the
router raises. Imported by the router, the client and `TargetPool` alike, so none of them
imports another for its records (nothing here imports torch)."""

from __future__ import annotations

from typing import NamedTuple

from eagle_ray.config.loader import ConfigError

# A lease: the replica's actor name and id (the client keeps a handle per id, `RouterLink`).
Grant = tuple[str, str]


class LeaseReport(NamedTuple):
    """What a client tells the router about a lease: a micro-batch's outcome on it (`ok`; None
    when there is none: a lease handed back unused) and, once the client hands the lease back,
    its tokens (`returned_tokens`; None while the client passes it on to its next micro-batch)."""

    replica: str
    served_tokens: int
    ok: bool | None
    replica_died: bool = False
    returned_tokens: int | None = None


Releases = list[LeaseReport] | tuple[()]


class NoReplicaAvailable(RuntimeError):
    """No replica could take a micro-batch in time; the message lists the replicas' states."""


class ReplicaStartupError(ConfigError):
    """Replicas could not build their target backend (the engine's own error, and the config
    key to change); the same configuration would fail on every replica, so the pool stops."""

    @classmethod
    def of(cls, pool: str, errors: dict[str, str], replicas: int) -> ReplicaStartupError:
        """The error for `errors` (replica name -> its start-up error) among `replicas`."""
        name, error = next(iter(sorted(errors.items())))
        return cls(f"{len(errors)} of {replicas} replicas of pool {pool!r} could not start "
                   f"their target backend ({name}: {error})")
