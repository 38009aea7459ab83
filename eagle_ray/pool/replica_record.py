"""The router's record of one replica: its state, load, health and history (what `status()`
shows and the routing policy reads)."""

from __future__ import annotations

import dataclasses
import time

from ray.actor import ActorHandle

from eagle_ray.pool.protocol import ReplicaInfo, ReplicaStatus
from eagle_ray.pool.states import ReplicaState
from eagle_ray.ray_compat import actor_id


@dataclasses.dataclass
class ReplicaRecord:
    """The router's record of one replica (its load, health and history)."""

    index: int
    name: str
    handle: ActorHandle
    state: ReplicaState = ReplicaState.STARTING  # -> READY <-> SUSPECT; DRAINING when removed
    outstanding_tokens: int = 0
    outstanding_micro_batches: int = 0
    peak_outstanding_tokens: int = 0
    served_tokens: int = 0
    served_micro_batches: int = 0
    leases: int = 0
    on_node_leases: int = 0  # leases to a client on this replica's node (docs/architecture.md)
    errors: int = 0
    restarts: int = 0
    first_served_at: float | None = None
    info: ReplicaInfo | None = None  # its latest answer to `ready()`
    probing: bool = False
    owned: bool = False  # seen among the controller's replicas (an added one may not be yet)

    @property
    def pid(self) -> int | None:
        return self.info.pid if self.info is not None else None

    @property
    def node_id(self) -> str | None:
        return self.info.node_id if self.info is not None else None

    @property
    def actor_id(self) -> str:
        """What a grant carries instead of the handle: clients look the actor up by name once
        and keep it while the id stays the same (a handle costs ~0.3 ms to deserialise)."""
        return actor_id(self.handle)

    def tokens_per_s(self) -> float:
        if self.first_served_at is None:
            return 0.0
        return self.served_tokens / max(time.monotonic() - self.first_served_at, 1e-6)

    def summary(self) -> ReplicaStatus:
        return ReplicaStatus(
            index=self.index, state=self.state,
            outstanding_tokens=self.outstanding_tokens,
            outstanding_micro_batches=self.outstanding_micro_batches,
            peak_outstanding_tokens=self.peak_outstanding_tokens,
            served_tokens=self.served_tokens,
            served_micro_batches=self.served_micro_batches,
            tokens_per_s=round(self.tokens_per_s(), 1),
            on_node_share=round(self.on_node_leases / self.leases, 3) if self.leases else None,
            errors=self.errors, restarts=self.restarts, node_id=self.node_id, pid=self.pid,
            error=self.info.startup_error if self.info is not None else None)
