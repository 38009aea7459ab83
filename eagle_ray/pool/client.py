"""The client a draft-training worker uses to get supervision from the pool.

Per micro-batch: validate here (before anything travels), put large inputs in the object store
once (small ones travel inside the call), get a lease (passed on from a finished micro-batch, or
asked from the router in batches: `router_link`), call the leased replica directly (those leased
on one replica at once share a call: `replica_calls`), and read the result from the object
store. The client owns every result, so it survives a router restart; it re-runs a micro-batch
on another replica when its replica dies, times out or reports an engine error, and drops late
duplicates; a micro-batch that runs out of memory is tried on one more replica, then fails with
`MicroBatchOutOfMemory`, and one whose supervision a replica refused for NaN or inf likewise
(`NonFiniteSupervision`). Results come back in submission order, exactly once.

Example:
    >>> client = PoolClient.connect("eagle_ray_pool", namespace="eagle_ray")  # doctest: +SKIP
    >>> for batch in client.stream(micro_batches):  # (input_ids, attention_mask, loss_mask)
    ...     train_step(batch)                                                     # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
from ray.exceptions import GetTimeoutError, RayActorError

from eagle_ray.backends.base import Sampling
from eagle_ray.config.pool import ClientConfig
from eagle_ray.contract.images import ImageInputs, MicroBatch
from eagle_ray.contract.target_batch import (
    Eagle3TargetBatch,
    validate_micro_batch,
    validate_prompts,
)
from eagle_ray.pool import replica_calls
from eagle_ray.pool.failures import (
    NON_FINITE_ATTEMPTS,
    OUT_OF_MEMORY_ATTEMPTS,
    FailureKind,
    classify,
    is_out_of_memory,
)
from eagle_ray.pool.inflight import InFlightMicroBatch, Window
from eagle_ray.pool.protocol import (
    MEMORY_ADVICE,
    ClientStats,
    MicroBatchFailed,
    MicroBatchOutOfMemory,
    NonFiniteSupervision,
    NoReplicaAvailable,
    ReplicaInfo,
    RequestKind,
)
from eagle_ray.pool.router_link import ROUTER_RETRY_S, Lease, RouterLink, RouterUnavailable
from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.pool.transport import pack_inputs

logger = logging.getLogger(__name__)



class PoolClient:
    """Submit micro-batches, receive `Eagle3TargetBatch`es; see the module docstring.

    Backpressure: at most `max_inflight_micro_batches` (and `max_inflight_tokens`) submitted and
    not yet consumed; `submit` waits for running ones to finish when the window is full. Build it
    with `PoolClient.connect` (or `TargetPool.client()`), not directly.

    Args:
        router: the link to the pool's router (`RouterLink.connect`).
        target_info: what a replica reported (vocabulary, longest row), to validate inputs.
        config: flow control and retries (`ClientConfig`).
    """

    def __init__(self, router: RouterLink, target_info: ReplicaInfo,
                 config: ClientConfig | None = None) -> None:
        self._router = router
        self.config = config or ClientConfig()
        self.vocab_size = target_info.vocab_size
        self.node_id = router.node_id
        self.max_length = target_info.max_length
        self.max_tokens_per_call = target_info.max_tokens_per_engine_call
        # Micro-batches a replica call carries: at most half the window, so a replica holds the
        # next call while it runs one; refills gather to this many (`stream`).
        self._per_call = min(self.config.max_micro_batches_per_call,
                             max(1, self.config.max_inflight_micro_batches // 2))
        self._ids = itertools.count()
        self._inflight = Window()
        self._fatal: BaseException | None = None  # a configuration error: every call raises it
        self.stats = router.stats = ClientStats()  # the link counts lapsed leases

    @classmethod
    def connect(cls, pool_name: str = "eagle_ray_pool", namespace: str = "eagle_ray",
                config: ClientConfig | None = None) -> PoolClient:
        """A client for a running pool, found by its `PoolConfig.name` and `namespace` (works
        from any job or actor); `config`: flow control and retries (None: the defaults)."""
        config = config or ClientConfig()
        try:
            link, info, unavailable = RouterLink.connect(pool_name, namespace, config)
        except RouterUnavailable as e:
            raise MicroBatchFailed(str(e)) from e
        client = cls(link, info, config)
        client.stats.router_retries = unavailable
        return client

    # ------------------------------------------------------------------ public API

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               loss_mask: torch.Tensor | None = None, images: ImageInputs | None = None) -> int:
        """Queue one micro-batch (with a vision-language target's `images` of its rows);
        returns its id. Bad input raises here, before it travels."""
        micro_batch_id = self._queue(input_ids, attention_mask, loss_mask, images)
        self._ask_for_leases()
        return micro_batch_id

    def _queue(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               loss_mask: torch.Tensor | None, images: ImageInputs | None = None) -> int:
        """`submit` without asking the router yet (`stream` asks for a window at once)."""
        self._raise_fatal()
        if loss_mask is None:
            loss_mask = attention_mask
        validate_micro_batch(input_ids, attention_mask, loss_mask, vocab_size=self.vocab_size,
                             max_length=self.max_length)
        if images is not None and images.rows != input_ids.shape[0]:
            raise ValueError(f"images_per_row has {images.rows} rows but input_ids has "
                             f"{input_ids.shape[0]}")
        num_tokens = int(attention_mask.sum())  # image tokens included: their placeholders
        self._wait_for_room(num_tokens)
        image_tensors = () if images is None else (
            images.pixels, images.image_sizes, images.images_per_row)
        return self._enqueue(pack_inputs(input_ids, attention_mask, loss_mask, *image_tensors),
                             num_tokens)

    def _enqueue(self, inputs: Any, num_tokens: int, **how: Any) -> int:
        micro_batch_id = next(self._ids)
        item = InFlightMicroBatch(micro_batch_id, inputs, num_tokens, **how)
        self._inflight[micro_batch_id] = item
        self.stats.submitted += 1
        self.stats.max_inflight = max(self.stats.max_inflight, len(self._inflight))
        return micro_batch_id

    def submit_completion(self, prompts: list[list[int]], sampling: Sampling) -> int:
        """Queue text generation for token-id `prompts` (answer regeneration); `result(id)` then
        returns the generated token lists. Exactly once and retried like supervision."""
        self._raise_fatal()
        validate_prompts(prompts, vocab_size=self.vocab_size, max_length=self.max_length,
                         max_new_tokens=sampling.max_new_tokens)
        num_tokens = sum(map(len, prompts)) + len(prompts) * sampling.max_new_tokens
        self._wait_for_room(num_tokens)
        request_id = self._enqueue(ray.put(([list(p) for p in prompts], sampling)),
                                   num_tokens, kind=RequestKind.COMPLETION, decode=list)
        self._ask_for_leases()
        return request_id

    def next_result(self) -> tuple[int, Eagle3TargetBatch]:
        """The oldest submitted micro-batch's supervision (blocks until it is ready)."""
        if not self._inflight:
            raise RuntimeError("no micro-batch in flight: submit() before next_result()")
        oldest = next(iter(self._inflight.values()))
        return oldest.micro_batch_id, self.result(oldest.micro_batch_id)

    def result(self, micro_batch_id: int) -> Eagle3TargetBatch:
        """The supervision of one submitted micro-batch; each is delivered exactly once."""
        try:
            return self._result(micro_batch_id)
        finally:
            self._router.flush()  # its lease's report: nothing else may come to carry it

    def _result(self, micro_batch_id: int) -> Any:
        item = self._inflight.get(micro_batch_id)
        if item is None:
            raise KeyError(f"micro-batch {micro_batch_id} is not in flight (never submitted, or "
                           f"already delivered)")
        started = time.monotonic()
        while not item.done:
            self._pump(timeout=1.0)
            self._raise_fatal()
        self.stats.wait_seconds += time.monotonic() - started
        del self._inflight[micro_batch_id]
        if item.error is not None:
            raise item.error  # its report goes with the caller's flush (`result`, `stream`)
        self.stats.delivered += 1
        return item.result

    def stream(self, micro_batches: Iterable[MicroBatch]) -> Iterator[Eagle3TargetBatch]:
        """Supervision for each `(input_ids, attention_mask, loss_mask[, images])`, in order,
        keeping up to the in-flight window submitted ahead (target latency overlaps the
        caller's work). While the next result is already there, refills wait to go together
        (`Window.ahead`)."""
        source = iter(micro_batches)
        upcoming = next(source, None)  # the next micro-batch, submitted once the window has room
        ready = None  # a result taken out of the window, handed over once the window is refilled
        try:
            while True:
                while upcoming is not None and self._has_room(int(upcoming[1].sum())):
                    self._queue(*upcoming)
                    upcoming = next(source, None)
                if upcoming is None or not self._inflight.ahead(self._per_call):
                    self._ask_for_leases()  # spare leases, then one call for the rest
                    self._settle(keep=sum(i.done for i in self._inflight.values()))  # refills
                if ready is not None:
                    yield ready
                if not self._inflight:
                    return
                ready = self._result(next(iter(self._inflight)))
        finally:
            self._router.flush()

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ flow control

    def _has_room(self, num_tokens: int = 0) -> bool:
        return self._inflight.has_room(self.config.max_inflight_micro_batches,
                                       self.config.max_inflight_tokens, num_tokens)

    def _wait_for_room(self, num_tokens: int) -> None:
        started = time.monotonic()
        while not self._has_room(num_tokens):
            self._raise_fatal()
            if all(i.done for i in self._inflight.values()):
                raise RuntimeError(
                    f"the in-flight window is full of results nobody consumed "
                    f"({len(self._inflight)} micro-batches): call next_result() before "
                    f"submitting more, or use stream()")
            self._pump(timeout=1.0)
        self.stats.wait_seconds += time.monotonic() - started

    # ------------------------------------------------------------------ the state machine

    def _ask_for_leases(self) -> None:
        """Spare leases for the micro-batches waiting that they fit, and one router call for the
        others."""
        matched = self._router.ask(self._inflight.unsent(), self.config.lease_timeout_s)
        self.stats.reused_leases += len(matched)
        self._run(matched)

    def _settle(self, keep: int | None) -> None:
        """Spare leases kept for micro-batches about to come (`RouterLink.settle`); none while
        one of ours waits for the router: a spare it cannot take goes back to be granted."""
        self._router.settle(keep=0 if self._inflight.asking() else keep)

    def _pump(self, timeout: float) -> None:
        """Advance every in-flight micro-batch whose leases or result are ready."""
        now = time.monotonic()
        for item in self._inflight.values():
            if item.phase is MicroBatchPhase.BACKOFF and now >= item.retry_lease_at:
                item.wait_for_lease()
        for item in self._inflight.overdue(now):
            if now >= item.lease.lapses:  # the client was away past the lease's term (a stall):
                self._router.lapsed(item.lease)  # not the replica's failure
                item.lease_lapsed()
            else:
                self._attempt_failed(item, f"timed out after {self.config.timeout_s:.0f}s",
                                     replica_died=False, cancel=True)
        self._ask_for_leases()
        waiting = self._inflight.waiting()
        self._settle(keep=None)  # before waiting
        if not waiting:
            time.sleep(min(timeout, ROUTER_RETRY_S))
            return
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            items = waiting[ref]
            if items[0].phase is MicroBatchPhase.LEASING:
                self._on_leases(ref, items)
            else:
                self._on_results(ref, items)

    def _on_leases(self, ref: ray.ObjectRef, items: list[InFlightMicroBatch]) -> None:
        for item in items:
            item.wait_for_lease()  # those not granted are asked for again next round
        try:
            leased = self._router.granted(ref, items)
        except NoReplicaAvailable as e:
            for item in items:
                item.fail(MicroBatchFailed(str(e)))
            return
        if leased is None:  # the router is restarting (or was replaced): ask again shortly
            self.stats.router_retries += 1
            for item in items:
                item.back_off(time.monotonic() + ROUTER_RETRY_S)
            return
        self._run(leased)

    def _run(self, leased: list[tuple[InFlightMicroBatch, Lease]]) -> None:
        """Call the leased replicas: one call per replica for the micro-batches leased on it
        now (`replica_calls`)."""
        for call in replica_calls.group_calls(leased, self._per_call, self.max_tokens_per_call):
            items = replica_calls.start(call, time.monotonic() + self.config.timeout_s)
            try:
                handle = self._router.replica(items[0].replica, items[0].lease.actor_id)
            except ValueError:  # removed since the grant
                for item in items:
                    self._attempt_failed(item, "replica removed", replica_died=False)
                continue
            replica_calls.send(handle, items)
            self.stats.replica_calls += 1

    def _on_results(self, ref: ray.ObjectRef, items: list[InFlightMicroBatch]) -> None:
        """The answer of one replica call, for each micro-batch it carried."""
        try:
            answers = replica_calls.answers(ref, items)
        except RayActorError as e:
            for item in items:
                if is_out_of_memory(e):  # killed by its node's memory monitor
                    self._out_of_memory(item, e, replica_died=True)
                else:
                    self._attempt_failed(item, f"replica died ({type(e).__name__})",
                                         replica_died=True)
            return
        except GetTimeoutError:  # not actually ready; look again next round
            return
        for item, own in zip(items, answers, strict=True):
            kind = classify(own) if isinstance(own, BaseException) else None
            if kind is FailureKind.OUT_OF_MEMORY:
                self._out_of_memory(item, own, replica_died=False)
                continue
            if kind is FailureKind.NON_FINITE:
                self._non_finite(item, own)
                continue
            if kind is FailureKind.TRANSIENT:
                self._attempt_failed(item, f"{type(own).__name__}: {own}", replica_died=False)
                continue
            self._release(item, ok=kind is None)
            if kind is not None:  # the same on every replica: never re-run
                item.fail(own)
                if kind is FailureKind.CONFIGURATION:
                    self._fatal = own
                continue
            self.stats.served_by[item.replica] += 1
            if item.replica in item.failed_on:
                self.stats.reruns_on_same_replica += 1
            item.succeed(item.decode(own))

    def _attempt_failed(self, item: InFlightMicroBatch, reason: str, replica_died: bool,
                        cancel: bool = False) -> None:
        """Re-run the micro-batch elsewhere; a late result of this attempt is dropped."""
        if cancel and item.result_ref is not None:
            ray.cancel(item.result_ref)
            self.stats.abandoned_attempts += 1
        self._release(item, ok=False, replica_died=replica_died)
        if item.attempt_failed(reason, self.config.max_attempts):
            logger.warning("micro-batch %d: %s; re-running on another replica",
                           item.micro_batch_id, item.errors[-1])
            self.stats.retries += 1

    def _out_of_memory(self, item: InFlightMicroBatch, error: BaseException,
                       replica_died: bool) -> None:
        """Not a replica's fault: tried once more on another replica, then the micro-batch's own
        error, naming memory, its size and what to change."""
        self._release(item, ok=False, replica_died=replica_died)
        item.out_of_memory += 1
        if item.out_of_memory < OUT_OF_MEMORY_ATTEMPTS and item.attempts < self.config.max_attempts:
            item.attempt_failed(f"out of memory: {error}", self.config.max_attempts)
            logger.warning("micro-batch %d (%d tokens) ran out of memory on a replica; trying "
                           "another once", item.micro_batch_id, item.num_tokens)
            self.stats.retries += 1
            return
        item.fail(error if isinstance(error, MicroBatchOutOfMemory) else MicroBatchOutOfMemory(
            f"micro-batch {item.micro_batch_id} ({item.num_tokens} tokens) ran out of memory "
            f"on {item.attempts} replica(s): {type(error).__name__}: {str(error)[:300]} -- "
            f"{MEMORY_ADVICE}"))

    def _non_finite(self, item: InFlightMicroBatch, error: BaseException) -> None:
        """NaN or inf from a replica's engine: tried once more on another replica (a broken
        device or weight shard is one replica's); from a second one too, the target's own for
        these rows, and the caller's error."""
        self._release(item, ok=False)
        item.nonfinite += 1
        if item.nonfinite < NON_FINITE_ATTEMPTS and item.attempts < self.config.max_attempts:
            item.attempt_failed(f"non-finite supervision: {error}", self.config.max_attempts)
            logger.warning("micro-batch %d: %s; trying another replica once",
                           item.micro_batch_id, error)
            self.stats.retries += 1
            return
        item.fail(NonFiniteSupervision(f"non-finite supervision from {item.nonfinite} "
                                       f"replica(s), the last: {error}"))

    def _raise_fatal(self) -> None:
        """A configuration error stops the client at once, whichever micro-batch it hit."""
        if self._fatal is not None:
            self._router.flush()
            raise self._fatal

    def _release(self, item: InFlightMicroBatch, ok: bool, replica_died: bool = False) -> None:
        self._router.finish(item.lease, item.num_tokens, ok, replica_died)
