"""The client's record of one submitted micro-batch (where it stands, what it went through) and
its window of them."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable
from typing import Any

import ray

from eagle_ray.pool.protocol import Lease, MicroBatchFailed, RequestKind
from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.pool.transport import batch_from_numpy


@dataclasses.dataclass
class InFlightMicroBatch:
    """One submitted micro-batch and where it stands."""

    micro_batch_id: int
    inputs: Any  # the replica method's argument (small arrays, or a ref put once), every attempt
    num_tokens: int
    kind: RequestKind = RequestKind.SUPERVISION
    decode: Callable[[Any], Any] = batch_from_numpy  # the replica's answer -> the result
    phase: MicroBatchPhase = MicroBatchPhase.LEASING
    lease_ref: ray.ObjectRef | None = None  # LEASING: the router's answer
    asked_at: float = 0.0  # LEASING: when the router was asked (its grant is dated from this)
    result_ref: ray.ObjectRef | None = None  # RUNNING: the replica's answer
    call_index: int | None = None  # RUNNING: its place in a `generate_many` call's answers
    replica: str | None = None  # RUNNING: who computes it
    lease: Lease | None = None  # RUNNING: the lease it runs on
    deadline: float = 0.0  # RUNNING: give up on this attempt after this time
    retry_lease_at: float = 0.0  # BACKOFF: ask the router again after this time
    attempts: int = 0
    out_of_memory: int = 0  # attempts that ran out of memory (failures.OUT_OF_MEMORY_ATTEMPTS)
    nonfinite: int = 0  # attempts refused for NaN or inf (failures.NON_FINITE_ATTEMPTS)
    failed_on: list[str] = dataclasses.field(default_factory=list)
    errors: list[str] = dataclasses.field(default_factory=list)
    result: Any = None  # SUCCEEDED: an Eagle3TargetBatch, or token lists (COMPLETION)
    error: BaseException | None = None  # FAILED

    # Its phase changes only here: LEASING -> RUNNING (a lease) -> SUCCEEDED; LEASING <->
    # BACKOFF (the router restarting); RUNNING -> LEASING (an attempt failed, re-run elsewhere);
    # any -> FAILED (attempts exhausted, no replica, or an error every replica would raise).

    @property
    def done(self) -> bool:
        return self.phase in (MicroBatchPhase.SUCCEEDED, MicroBatchPhase.FAILED)

    def wait_for_lease(self) -> None:
        """It needs a replica: a spare lease, or the router's in the next round."""
        self.phase, self.lease_ref = MicroBatchPhase.LEASING, None

    def back_off(self, until: float) -> None:
        """The router is restarting: ask it again at `until` (monotonic)."""
        self.phase, self.lease_ref, self.retry_lease_at = MicroBatchPhase.BACKOFF, None, until

    def start(self, lease: Lease, deadline: float, call_index: int | None) -> None:
        """One attempt on `lease`'s replica until `deadline`; its answer is at `call_index` of a
        shared call's (None: a call of its own)."""
        self.phase, self.lease, self.replica = MicroBatchPhase.RUNNING, lease, lease.replica
        self.attempts, self.deadline, self.call_index = self.attempts + 1, deadline, call_index

    def attempt_failed(self, reason: str, max_attempts: int) -> bool:
        """Record why this attempt failed and drop its result; True when another may run
        (waiting for a lease again), False when it failed for good."""
        self.failed_on.append(self.replica)
        self.errors.append(f"{self.replica}: {reason}")
        self.result_ref, self.replica = None, None
        if self.attempts >= max_attempts:
            self.fail(MicroBatchFailed(f"micro-batch {self.micro_batch_id} failed {self.attempts} "
                                   f"times: " + "; ".join(self.errors)))
            return False
        self.wait_for_lease()
        return True

    def lease_lapsed(self) -> None:
        """Its lease may have been taken back while the client was away (a stall past the
        lease's term): run it again on a fresh lease; the attempt given up is not counted
        against it (nothing failed), and its late result is dropped."""
        ray.cancel(self.result_ref)
        self.attempts -= 1
        self.result_ref, self.replica = None, None
        self.wait_for_lease()

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

    def waiting(self) -> dict[ray.ObjectRef, list[InFlightMicroBatch]]:
        """Micro-batches by what they wait for: the router's answer, or their replica call's."""
        refs: dict[ray.ObjectRef, list[InFlightMicroBatch]] = collections.defaultdict(list)
        for item in self.values():
            if item.phase is MicroBatchPhase.LEASING:
                refs[item.lease_ref].append(item)
            elif item.phase is MicroBatchPhase.RUNNING:
                refs[item.result_ref].append(item)
        return refs

    def overdue(self, now: float) -> list[InFlightMicroBatch]:
        """Running micro-batches past their attempt's deadline whose result is not in: a result
        that arrived while the client was away (a stall) is taken, not thrown away."""
        late = [i for i in self.values() if i.phase is MicroBatchPhase.RUNNING and now > i.deadline]
        refs = list(dict.fromkeys(i.result_ref for i in late))
        done = set(ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)[0]
                   if refs else [])
        return [i for i in late if i.result_ref not in done]

    def asking(self) -> bool:
        """Whether one of them waits for the router's answer."""
        return any(i.phase is MicroBatchPhase.LEASING and i.lease_ref is not None
                   for i in self.values())

    def ahead(self, gather: int) -> bool:
        """Whether the oldest result is already there (the pool is ahead of the caller) and
        fewer than `gather` micro-batches wait unsent: then they may wait to go together."""
        oldest = next(iter(self.values()), None)
        return oldest is not None and oldest.done and len(self.unsent()) < gather
