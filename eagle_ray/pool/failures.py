"""What a failed micro-batch means, decided in one place for the replica and the client.

- Bad input is the same on every replica: the caller gets the error, nothing is retried, and the
  replica keeps serving.
- A configuration error (the self-check: wrong layer-id convention, a norm applied twice, a dtype
  mismatch) repeats on every replica: the client stops the stream at once with its message.
- Anything else is transient (a dead or hung replica, an engine fault): the replica restarts with
  a fresh engine and the client re-runs the micro-batch on another replica.
"""

from __future__ import annotations

import enum

from eagle_ray.target_runner import SelfCheckError


class FailureKind(enum.Enum):
    """How the pool reacts to an error raised while serving a micro-batch."""

    BAD_INPUT = "bad_input"
    """The micro-batch is wrong; every replica would refuse it. Report, do not retry."""

    CONFIGURATION = "configuration"
    """The target is misconfigured; every replica would repeat it. Stop the job."""

    TRANSIENT = "transient"
    """This replica or attempt failed. Restart the engine, re-run elsewhere."""


def classify(error: BaseException) -> FailureKind:
    """The kind of `error` (the original exception, not Ray's wrapper)."""
    if isinstance(error, SelfCheckError | NotImplementedError):  # e.g. a backend without text
        return FailureKind.CONFIGURATION
    if isinstance(error, ValueError | TypeError):
        return FailureKind.BAD_INPUT
    return FailureKind.TRANSIENT
