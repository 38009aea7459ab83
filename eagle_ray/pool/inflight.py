"""The client's record of one submitted micro-batch: where it stands and what it went through."""

from __future__ import annotations

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
    inputs: ray.ObjectRef  # the replica method's argument, put once, reused on every attempt
    num_tokens: int
    method: str = "generate"  # the replica method: supervision, or "complete" for text
    decode: Callable[[Any], Any] = batch_from_numpy  # the replica's answer -> the result
    phase: MicroBatchPhase = MicroBatchPhase.LEASING
    lease_ref: ray.ObjectRef | None = None  # LEASING: the router's answer
    result_ref: ray.ObjectRef | None = None  # RUNNING: the replica's answer
    replica: str | None = None  # RUNNING: who computes it
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
