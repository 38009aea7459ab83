"""The replica actor: one target backend (vLLM by default) inside its own placement group.

It accepts up to `PoolConfig.replica_concurrency` calls at once, each carrying one micro-batch or
several (`generate_many`); an `EngineQueue` feeds them to the engine, merged, from one thread, and
finishes each engine call's output on another while the engine runs the next
(`eagle_ray.pool.engine_queue`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import ray
import torch

from eagle_ray.backends import build_backend, resolve_model_path
from eagle_ray.backends.base import Sampling
from eagle_ray.config.pool import PoolConfig
from eagle_ray.contract.finite import nonfinite_fields
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.images import ImageInputs, MicroBatch
from eagle_ray.contract.target_batch import Eagle3TargetBatch, validate_prompts
from eagle_ray.pool.engine_queue import EngineQueue
from eagle_ray.pool.failures import (
    DEATHS_WHILE_STARTING,
    FailureKind,
    StartAttempts,
    classify,
    free_memory,
    startup_error,
)
from eagle_ray.pool.protocol import MicroBatchOutOfMemory, NonFiniteSupervision, ReplicaInfo
from eagle_ray.pool.transport import Payload, batch_to_numpy

logger = logging.getLogger(__name__)

PROBE_TOKENS = 8  # the micro-batch a replica checks its engine with after running out of memory


def _node_object_store_bytes() -> int:
    """The Ray object store's capacity on this replica's node (it shares /dev/shm with vLLM's
    hand-off ring, which is sized against it)."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node["NodeID"] == node_id:
            return int(node["Resources"].get("object_store_memory", 0))
    return 0


def micro_batch_tensors(inputs: Any) -> MicroBatch:
    """`(input_ids, attention_mask, loss_mask)` arrays as tensors, and a vision-language
    micro-batch's images from three more (`pixels, image_sizes, images_per_row`);
    anything else is bad input."""
    if not isinstance(inputs, tuple | list) or len(inputs) not in (3, 6):
        raise TypeError(f"a micro-batch is three arrays (input_ids, attention_mask, loss_mask), "
                        f"and three more with images, got {type(inputs).__name__} "
                        f"{str(inputs)[:80]}")
    try:
        tensors = [torch.tensor(a) for a in inputs]  # a copy: store arrays are read-only
    except Exception as e:  # object arrays, strings, ragged lists
        raise TypeError(f"micro-batch arrays must be numeric, got "
                        f"{[type(a).__name__ for a in inputs]}: {e}") from e
    if len(tensors) == 3:
        return tuple(tensors)
    return (*tensors[:3], ImageInputs(*tensors[3:]))


def encode_answer(batch: Eagle3TargetBatch, encoding_dtype: str, micro_batch: MicroBatch
                  ) -> Payload | MicroBatchOutOfMemory:
    """`batch` as arrays for the object store (fp8: quantised on the engine's device, off the
    engine thread), or, where that runs out of memory, the micro-batch's own
    `MicroBatchOutOfMemory` (memory freed): the other micro-batches of the call go on."""
    try:
        return batch_to_numpy(batch, encoding_dtype)
    except Exception as e:
        if classify(e) is not FailureKind.OUT_OF_MEMORY:
            raise
        free_memory(e)
        ids, attention = micro_batch[:2]
        return MicroBatchOutOfMemory.of(e, *ids.shape, int(attention.sum()))


def refuse_nonfinite(batch: Eagle3TargetBatch, micro_batch_id: int, replica: str
                     ) -> Eagle3TargetBatch | NonFiniteSupervision:
    """`batch`, or, where the engine returned NaN or inf in it, the micro-batch's own
    `NonFiniteSupervision` naming the tensors, counts and rows (`contract.finite`: one reduction
    per tensor where the batch lies, before it is encoded and copied out)."""
    found = nonfinite_fields(batch)
    if not found:
        return batch
    return NonFiniteSupervision.of("; ".join(map(str, found)), micro_batch_id, replica,
                                   *batch.input_ids.shape)


class TargetReplica:
    """Ray actor owning one target backend; the router hands its handle to clients.

    Errors are sorted by `failures.classify`: bad input and configuration errors are returned to
    the caller and the replica keeps serving; a micro-batch that runs out of memory fails alone
    (`MicroBatchOutOfMemory`) while the replica frees the memory and checks its engine; one whose
    supervision holds NaN or inf is refused alone (`NonFiniteSupervision`); anything
    else from the engine ends the process so Ray restarts the actor with a fresh engine instead
    of leaving a replica that fails every call.
    """

    def __init__(self, config: PoolConfig, index: int) -> None:
        logging.basicConfig(level=logging.INFO)
        self.index = index
        self.config = config
        self.started = time.time()
        self.startup_error: str | None = None
        attempts = StartAttempts(ray.get_runtime_context().get_actor_id())
        died = attempts.begin()
        try:
            if died >= DEATHS_WHILE_STARTING:
                self.startup_error = attempts.error(died)
                logger.error("replica %d: %s", index, self.startup_error)
                return
            self.backend = build_backend(config, object_store_bytes=_node_object_store_bytes())
        except Exception as e:
            # Kept, not raised: Ray would restart the actor and fail again, forever. The router
            # marks the replica failed and the pool reports why (`ReplicaState.FAILED`).
            logger.exception("replica %d: the target backend could not be built", index)
            self.startup_error = startup_error(e)
            return
        finally:
            attempts.end()
        self.identity = TargetIdentity.of_backend(self.backend, resolve_model_path(config))
        self.encoding_dtype = config.encoding_dtype
        self.served_tokens = 0
        self.served_micro_batches = 0
        self.nonfinite_refused = 0
        context = ray.get_runtime_context()
        self.name = (f"replica {config.replica_name(index)} (node {context.get_node_id()[:12]}, "
                     f"pid {os.getpid()}, GPU {ray.get_gpu_ids() or 'none'})")
        self._count_lock = threading.Lock()
        # Supervision leaves the engine for host memory (the object store); for fp8 it is
        # quantised first, on the engine's device, so the copy moves half the bytes too (vLLM
        # hands its states over in host memory: they make a trip to the GPU for it, which costs
        # less than quantising a batch on the host's cores).
        where = None if config.encoding_dtype == "fp8" else "cpu"
        # Each micro-batch is checked once on arrival (`generate_many`), before it is merged.
        self.engine = EngineQueue(
            lambda micro_batch: self.backend.run_engine(
                *micro_batch[:3], checked=True,
                images=micro_batch[3] if len(micro_batch) > 3 else None),
            lambda engine_output: self.backend.finish_batch(engine_output, device=where),
            self._serve, config.max_tokens_per_engine_call, name=f"engine-{index}",
            pipelined=config.replica_pipeline, recover=self._recover_from_out_of_memory)
        logger.info("replica %d ready on node %s", index,
                    ray.get_runtime_context().get_node_id())

    @ray.method(concurrency_group="health")
    def ready(self) -> ReplicaInfo:
        """Where this replica runs and what its target accepts (also the router's liveness
        probe; its own concurrency group, so it answers while `generate` is busy)."""
        context = ray.get_runtime_context()
        where = {"index": self.index, "node_id": context.get_node_id(), "pid": os.getpid()}
        if self.startup_error is not None:
            return ReplicaInfo(**where, startup_error=self.startup_error)
        return ReplicaInfo(
            **where,
            gpu_ids=[str(g) for g in ray.get_gpu_ids()],
            vocab_size=self.backend.vocab_size,
            max_length=self.backend.max_length,
            aux_layer_ids=list(self.backend.aux_layer_ids),
            identity=self.identity,
            served_tokens=self.served_tokens,
            served_micro_batches=self.served_micro_batches,
            engine=dataclasses.replace(self.engine.stats,
                                       handoff_overflows=self.backend.runner.handoff_overflows,
                                       nonfinite_refused=self.nonfinite_refused),
            max_tokens_per_engine_call=self.engine.max_tokens,
        )

    @ray.method(concurrency_group="generate")
    def generate(self, micro_batch_id: int, inputs: tuple[np.ndarray, np.ndarray, np.ndarray],
                 ) -> Payload:
        """Supervision for one micro-batch `(input_ids, attention_mask, loss_mask)`, as numpy
        arrays for the object store; raises what `generate_many` would answer."""
        (answer,) = self.generate_many([micro_batch_id], inputs)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    @ray.method(concurrency_group="generate")
    def generate_many(self, micro_batch_ids: list[int], *inputs: Any,
                      ) -> list[Payload | BaseException]:
        """Supervision for several micro-batches in one call: what a client leased on this
        replica at once travels in one Ray call, not one each, and the micro-batches merge into
        shared engine calls. Each is checked here, so bad input never joins a merged call; each
        answer is its payload or the error it raised, so one bad micro-batch fails alone (bad
        input, out of memory, NaN or inf in its supervision)."""
        answers: list[Any] = [None] * len(inputs)
        checked: dict[int, tuple[torch.Tensor, ...]] = {}
        for index, arrays in enumerate(inputs):
            try:
                micro_batch = micro_batch_tensors(arrays)
                self.backend.validate(*micro_batch)
                checked[index] = micro_batch
            except (TypeError, ValueError) as e:
                answers[index] = e
        for index, answer in zip(checked, self.engine.generate_many(list(checked.values())),
                                 strict=True):
            if not isinstance(answer, BaseException):
                answer = self._refuse_nonfinite(answer, micro_batch_ids[index])
            if not isinstance(answer, BaseException):
                answer = encode_answer(answer, self.encoding_dtype, checked[index])
            if not isinstance(answer, BaseException):
                self._count(int(checked[index][1].sum()))
            answers[index] = answer
        return answers

    @ray.method(concurrency_group="generate")
    def complete(self, request_id: int, request: tuple[list[list[int]], Sampling]
                 ) -> list[list[int]]:
        """Generated tokens for `(prompts, sampling)` (answer regeneration), with the same engine
        and the same error handling as `generate`."""
        prompts, sampling = request
        validate_prompts(prompts, vocab_size=self.backend.vocab_size,
                         max_length=self.backend.max_length,
                         max_new_tokens=sampling.max_new_tokens)
        generated = self.engine.call(lambda: self.backend.complete(prompts, sampling))
        self._count(sum(map(len, prompts)) + sum(map(len, generated)))
        return generated

    def _refuse_nonfinite(self, batch: Eagle3TargetBatch, micro_batch_id: int
                          ) -> Eagle3TargetBatch | NonFiniteSupervision:
        answer = refuse_nonfinite(batch, micro_batch_id, self.name)
        if isinstance(answer, NonFiniteSupervision):
            with self._count_lock:
                self.nonfinite_refused += 1
            logger.warning("%s", answer)
        return answer

    def _count(self, tokens: int) -> None:
        with self._count_lock:  # request threads finish concurrently
            self.served_tokens += tokens
            self.served_micro_batches += 1

    def _recover_from_out_of_memory(self) -> None:
        """After an engine call ran out of memory (on the engine thread, once that call's
        micro-batches have their answer): free what it took and check the engine still serves a
        small micro-batch correctly (vLLM's self-check runs on it). An engine broken by it is
        rebuilt in this process (`engine_restarts`); the waiting micro-batches then run on the
        new one. One that cannot be rebuilt ends the process (Ray restarts the replica)."""
        free_memory()
        if self._engine_works():
            logger.warning("replica %d: a micro-batch ran out of memory; memory freed, the "
                           "engine still serves", self.index)
            return
        logger.error("replica %d: its engine fails after running out of memory; building a "
                     "new one", self.index)
        self.backend.shutdown()
        try:
            self.backend = build_backend(self.config,
                                         object_store_bytes=_node_object_store_bytes())
        except Exception:
            logger.exception("replica %d: no new engine; exiting so Ray restarts this replica",
                             self.index)
            os._exit(1)
        self.engine.stats.engine_restarts += 1
        if not self._engine_works():
            os._exit(1)

    def _engine_works(self) -> bool:
        """Whether the engine serves a small micro-batch (the self-check included)."""
        probe = torch.arange(1, PROBE_TOKENS + 1).remainder(self.backend.vocab_size).view(1, -1)
        try:
            self.backend.generate_batch(probe, torch.ones_like(probe), device="cpu")
        except Exception:
            logger.exception("replica %d: the engine check failed", self.index)
            return False
        return True

    def _serve(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the engine; a transient failure ends the process (Ray restarts it, and
        every micro-batch it held is re-run elsewhere by its client)."""
        try:
            return call()
        except Exception as e:
            if classify(e) is not FailureKind.TRANSIENT:
                raise
            logger.exception("replica %d: engine failed; exiting so Ray restarts this replica "
                             "with a fresh engine", self.index)
            os._exit(1)
