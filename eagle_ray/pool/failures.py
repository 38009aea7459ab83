"""What a failed micro-batch means, decided in one place for the replica and the client.

- Bad input is the same on every replica: the caller gets the error, nothing is retried, and the
  replica keeps serving.
- A configuration error (the self-check: wrong layer-id convention, a norm applied twice, a dtype
  mismatch) repeats on every replica: the client stops the stream at once with its message.
- Out of memory is the micro-batch's error, not the replica's: the replica frees what the call
  took, checks its engine and keeps serving; the client tries the micro-batch once more on
  another replica, then raises `MicroBatchOutOfMemory` (its size and what to change).
- Non-finite supervision (NaN or inf from the engine) is refused by the replica, which keeps
  serving: a broken device or weight shard is one replica's, so the client tries the
  micro-batch once more on another; from a second replica too, it is the target's own for
  those rows (fp16 overflow, a NaN weight) and the caller gets `NonFiniteSupervision`.
- Anything else is transient (a dead or hung replica, an engine fault): the replica restarts with
  a fresh engine and the client re-runs the micro-batch on another replica.
"""

from __future__ import annotations

import enum
import gc
import re

import torch

from eagle_ray.backends.base import SelfCheckError
from eagle_ray.pool.protocol import MicroBatchOutOfMemory, NonFiniteSupervision
from eagle_ray.ray_compat import kv_delete, kv_get, kv_put

# A replica whose process dies this many times while building its backend (an abort, a segfault,
# the out-of-memory killer: nothing it could catch) stops trying and reports itself failed.
DEATHS_WHILE_STARTING = 2


class FailureKind(enum.Enum):
    """How the pool reacts to an error raised while serving a micro-batch."""

    BAD_INPUT = "bad_input"
    """The micro-batch is wrong; every replica would refuse it. Report, do not retry."""

    CONFIGURATION = "configuration"
    """The target is misconfigured; every replica would repeat it. Stop the job."""

    OUT_OF_MEMORY = "out_of_memory"
    """The engine ran out of memory on this micro-batch. The replica stays; try once more."""

    NON_FINITE = "non_finite"
    """The engine returned NaN or inf for it. The replica stays; try once more elsewhere."""

    TRANSIENT = "transient"
    """This replica or attempt failed. Restart the engine, re-run elsewhere."""


# What to change when a replica's backend cannot be built: (words in the error, the advice).
STARTUP_HINTS = (
    (("max seq len", "max_model_len", "KV cache"),
     "lower target.vllm_kwargs.max_model_len (a job sizes it from data.max_length) or give the "
     "engine more KV cache memory (target.vllm_kwargs.gpu_memory_utilization, or "
     "kv_cache_memory_bytes on the CPU)"),
    (("vllm_kwargs", "unexpected keyword", "EngineArgs"),
     "fix target.vllm_kwargs (keys are vllm.LLM's arguments; the backend owns model, "
     "speculative_config, kv_transfer_config and skip_tokenizer_init)"),
    (("safetensors", "No such file", "does not appear to have", "not a valid"),
     "point target.model_path at an HF checkpoint folder with config.json and safetensors "
     "weights"),
    (("tokenizer",), "give target.model_path a folder with the tokenizer files, or pass "
     "target.vllm_kwargs.tokenizer"),
)


def startup_error(error: BaseException) -> str:
    """The message a pool reports for a replica whose backend could not be built: the error
    itself and, where it is recognised, the config key to change."""
    message = f"{type(error).__name__}: {error}"
    for words, advice in STARTUP_HINTS:
        if any(word.lower() in message.lower() for word in words):
            return f"{message} -- {advice}"
    return message


OUT_OF_MEMORY_ATTEMPTS = 2  # a micro-batch that ran out of memory is tried once more elsewhere
NON_FINITE_ATTEMPTS = 2  # and one whose supervision held NaN or inf
# torch's and Ray's out-of-memory errors by name (torch.OutOfMemoryError, the CUDA one,
# ray.exceptions.OutOfMemoryError), and the words CUDA, vLLM and Ray's memory monitor use.
_OUT_OF_MEMORY = re.compile(r"out[ _]of[ _]memory|OutOfMemory|memory pressure", re.IGNORECASE)
def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` says memory ran out (its type or its words)."""
    return isinstance(error, MemoryError | MicroBatchOutOfMemory) or bool(
        _OUT_OF_MEMORY.search(f"{type(error).__name__} {error}"))


def free_memory(error: BaseException | None = None) -> None:
    """Give back what a call that ran out of memory took: its garbage now, and the caching
    allocator's free blocks to the device (the next call may need them in other sizes).
    `error`: the out-of-memory error, whose traceback is dropped first (its frames hold the
    call's tensors)."""
    if error is not None:
        error.__traceback__ = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def classify(error: BaseException) -> FailureKind:
    """The kind of `error` (the original exception, not Ray's wrapper)."""
    if is_out_of_memory(error):
        return FailureKind.OUT_OF_MEMORY
    if isinstance(error, NonFiniteSupervision):
        return FailureKind.NON_FINITE
    if isinstance(error, SelfCheckError | NotImplementedError):  # e.g. a backend without text
        return FailureKind.CONFIGURATION
    if isinstance(error, ValueError | TypeError):
        return FailureKind.BAD_INPUT
    return FailureKind.TRANSIENT


class StartAttempts:
    """Constructions of one replica actor that died unfinished, counted in Ray's key-value store
    under the actor's id (which Ray's restarts keep): an exception is kept by the replica itself,
    but a process that dies while building its backend leaves only this count behind, so the
    restarted actor knows not to try forever."""

    def __init__(self, actor_id: str) -> None:
        self.actor_id = actor_id
        self._key = f"eagle_ray:constructions:{actor_id}".encode()

    def begin(self) -> int:
        """Count this construction; returns how many before it died unfinished."""
        died = int(kv_get(self._key) or 0)
        kv_put(self._key, str(died + 1).encode())
        return died

    def end(self) -> None:
        """This construction finished (built, or failed with an error the replica keeps)."""
        kv_delete(self._key)

    def error(self, died: int) -> str:
        """The start-up error of a replica whose earlier constructions died."""
        return (f"the replica's process died {died} times while building its target backend "
                f"(an abort, a crash or the out-of-memory killer; the reason is in its worker "
                f"log: `ray logs actor --id {self.actor_id}`) -- check the node's free memory "
                f"and target.vllm_kwargs (gpu_memory_utilization, max_model_len)")
