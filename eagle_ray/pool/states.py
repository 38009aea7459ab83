"""Named states of the pool's moving parts: a replica as the router sees it, a micro-batch as the
client sees it. Logic-free (imports nothing of eagle_ray), so the router, the client and the
routing policy share these names without depending on each other.
"""

from __future__ import annotations

import enum


class ReplicaState(enum.Enum):
    """A replica's state in the router; `status()` reports the value."""

    STARTING = "starting"
    """Created; its `ready()` has not answered yet (engine loading, or placement pending)."""

    READY = "ready"
    """Answered `ready()`; takes leases."""

    SUSPECT = "suspect"
    """A call on it died or a probe failed; no leases until a probe answers again."""

    DRAINING = "draining"
    """Being removed: no new leases, leases already granted finish."""

    FAILED = "failed"
    """Its target backend could not be built (the engine's error is in `status()`); it takes
    no leases and is not restarted: the same configuration would fail the same way."""


class MicroBatchPhase(enum.Enum):
    """Where one submitted micro-batch stands in its client."""

    LEASING = "leasing"
    """The router was asked for a replica; the lease has not arrived."""

    BACKOFF = "backoff"
    """The router was unreachable (restarting); ask it again after a pause."""

    RUNNING = "running"
    """The leased replica computes it; its result has not arrived."""

    SUCCEEDED = "succeeded"
    """Its supervision arrived; it waits to be consumed, in submission order."""

    FAILED = "failed"
    """No replica could serve it; the error waits to be raised when it is consumed."""
