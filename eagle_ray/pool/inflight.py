"""The client's record of one submitted micro-batch (where it stands, what it went through), its
window of them, and its counters."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import ray

from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.pool.transport import batch_from_numpy


@dataclasses.dataclass
class InFlightMicroBatch:
    """One submitted micro-batch and where it stands."""

    micro_batch_id: int
    inputs: Any  # the replica method's argument (small arrays, or a ref put once), every attempt
    num_tokens: int
    method: str = "generate"  # the replica method: supervision, or "complete" for text
    decode: Callable[[Any], Any] = batch_from_numpy  # the replica's answer -> the result
    phase: MicroBatchPhase = MicroBatchPhase.LEASING
    lease_ref: ray.ObjectRef | None = None  # LEASING: the router's answer
    result_ref: ray.ObjectRef | None = None  # RUNNING: the replica's answer
    call_index: int | None = None  # RUNNING: its place in a `generate_many` call's answers
    replica: str | None = None  # RUNNING: who computes it
    lease: Any = None  # RUNNING: the `router_link.Lease` it runs on
    deadline: float = 0.0  # RUNNING: give up on this attempt after this time
    retry_lease_at: float = 0.0  # BACKOFF: ask the router again after this time
    attempts: int = 0
    failed_on: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    result: Any = None  # SUCCEEDED: an Eagle3TargetBatch, or token lists for "complete"
    error: BaseException | None = None  # FAILED

    @property
    def done(self) -> bool:
        return self.phase in (MicroBatchPhase.SUCCEEDED, MicroBatchPhase.FAILED)

    def succeed(self, result: Any) -> None:
        self.phase, self.result, self.result_ref = MicroBatchPhase.SUCCEEDED, result, None

    def fail(self, error: BaseException) -> None:
        self.phase, self.error, self.result_ref = MicroBatchPhase.FAILED, error, None


class Window(collections.OrderedDict):
    """A client's submitted, unconsumed micro-batches by id, oldest first: the in-flight window
    that `ClientConfig.max_inflight_micro_batches` and `max_inflight_tokens` bound."""

    def has_room(self, max_micro_batches: int, max_tokens: int, num_tokens: int = 0) -> bool:
        """Whether one more of `num_tokens` fits (one always fits an empty window)."""
        tokens = sum(i.num_tokens for i in self.values())
        return not self or (len(self) < max_micro_batches and tokens + num_tokens <= max_tokens)

    def unsent(self) -> list[InFlightMicroBatch]:
        """Micro-batches waiting for a lease that have not asked the router yet."""
        return [i for i in self.values()
                if i.phase is MicroBatchPhase.LEASING and i.lease_ref is None]

    def asking(self) -> bool:
        """Whether one of them waits for the router's answer."""
        return any(i.phase is MicroBatchPhase.LEASING and i.lease_ref is not None
                   for i in self.values())

    def ahead(self, gather: int) -> bool:
        """Whether the oldest result is already there (the pool is ahead of the caller) and
        fewer than `gather` micro-batches wait unsent: then they may wait to go together."""
        oldest = next(iter(self.values()), None)
        return oldest is not None and oldest.done and len(self.unsent()) < gather


def client_stats() -> dict[str, Any]:
    """A client's counters (`PoolClient.stats`). retries: attempts re-run after a failure, of
    which reruns_on_same_replica landed on a replica that had already failed them;
    router_retries: calls to an unavailable router; reused_leases: micro-batches run on a lease
    passed on from a finished one (no router call); replica_calls: calls to replicas (several
    micro-batches can share one); served_by: results received per replica."""
    return {"submitted": 0, "delivered": 0, "retries": 0, "reruns_on_same_replica": 0,
            "abandoned_attempts": 0, "router_retries": 0, "max_inflight": 0,
            "wait_seconds": 0.0, "reused_leases": 0, "replica_calls": 0,
            "served_by": collections.Counter()}
