"""The client a draft-training worker uses to get supervision from the pool.

Per micro-batch: validate here (before anything travels), put the inputs in the object store once,
ask the router for a lease, call the leased replica directly, and read the result from the object
store. The client owns every result, so it survives a router restart; it re-runs a micro-batch on
another replica when its replica dies, times out or reports an engine error, and drops late
duplicates. Results come back in submission order, exactly once.

Example:
    >>> client = PoolClient.connect("eagle_ray_pool", namespace="eagle_ray")  # doctest: +SKIP
    >>> for batch in client.stream(micro_batches):  # (input_ids, attention_mask, loss_mask)
    ...     train_step(batch)                                                     # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

import ray
import torch
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.pool.failures import FailureKind, classify
from eagle_ray.pool.inflight import InFlightMicroBatch
from eagle_ray.pool.router import NoReplicaAvailable
from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.target_batch import Eagle3TargetBatch, validate_micro_batch, validate_prompts
from eagle_ray.target_runner import Sampling

logger = logging.getLogger(__name__)

ROUTER_RETRY_S = 0.5  # pause before asking a restarting router again
MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class MicroBatchFailed(RuntimeError):
    """A micro-batch could not be served; the message says where it was tried and why."""


class PoolClient:
    """Submit micro-batches, receive `Eagle3TargetBatch`es; see the module docstring.

    Backpressure: at most `max_inflight_micro_batches` (and `max_inflight_tokens`) submitted and
    not yet consumed; `submit` waits for running ones to finish when the window is full. Build it
    with `PoolClient.connect` (or `TargetPool.client()`), not directly.

    Args:
        router: the pool's router actor.
        target_info: what a replica reported (`vocab_size`, `max_length`), to validate inputs.
        config: flow control and retries (`ClientConfig`).
        router_name: the router's actor name, to find it again after it restarts.
        namespace: the pool's Ray namespace.
    """

    def __init__(self, router: ActorHandle, target_info: dict[str, Any],
                 config: ClientConfig | None = None, router_name: str | None = None,
                 namespace: str | None = None) -> None:
        self._router = router
        self._router_name, self._namespace = router_name, namespace
        self.config = config or ClientConfig()
        self.vocab_size = int(target_info["vocab_size"])
        self.node_id = ray.get_runtime_context().get_node_id()  # for locality-aware leases
        self.max_length = target_info.get("max_length")
        self._ids = itertools.count()
        self._inflight: collections.OrderedDict[int, InFlightMicroBatch] = collections.OrderedDict()
        self._fatal: BaseException | None = None  # a configuration error: every call raises it
        # retries: attempts re-run after a failure, of which reruns_on_same_replica landed on a
        # replica that had already failed them; router_retries: calls to an unavailable router;
        # served_by: results received per replica name.
        self.stats = {"submitted": 0, "delivered": 0, "retries": 0, "reruns_on_same_replica": 0,
                      "abandoned_attempts": 0, "router_retries": 0, "max_inflight": 0,
                      "wait_seconds": 0.0, "served_by": collections.Counter()}

    @classmethod
    def connect(cls, pool_name: str = "eagle_ray_pool", namespace: str = "eagle_ray",
                config: ClientConfig | None = None) -> PoolClient:
        """A client for a running pool, found by name (works from any job or actor).

        Args:
            pool_name: the pool's `name` (`PoolConfig.name`).
            namespace: the pool's Ray namespace (`PoolConfig.namespace`).
            config: flow control and retries; None: `ClientConfig()` defaults.
        """
        router_name = PoolConfig(name=pool_name, namespace=namespace).router_name
        config = config or ClientConfig()
        deadline = time.monotonic() + config.lease_timeout_s
        unavailable = 0
        while True:
            try:
                router = ray.get_actor(router_name, namespace=namespace)
            except ValueError:
                raise ValueError(f"no eagle_ray pool named {pool_name!r} in namespace "
                                 f"{namespace!r}; start one with `eagle-ray serve` or "
                                 f"TargetPool.create") from None
            try:
                info = ray.get(router.target_info.remote(config.lease_timeout_s),
                               timeout=max(deadline - time.monotonic(), 1.0))
                break
            except RayActorError as e:  # the router is restarting: wait for it
                unavailable += 1
                if time.monotonic() > deadline:
                    raise MicroBatchFailed(f"the router of pool {pool_name!r} stayed unavailable "
                                           f"for {config.lease_timeout_s:.0f}s: {e}") from e
                logger.warning("router of pool %r unavailable (%s); retrying", pool_name,
                               type(e).__name__)
                time.sleep(ROUTER_RETRY_S)
        client = cls(router, info, config, router_name, namespace)
        client.stats["router_retries"] = unavailable
        return client

    # ------------------------------------------------------------------ public API

    def submit(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               loss_mask: torch.Tensor | None = None) -> int:
        """Queue one micro-batch; returns its id. Bad input raises here, before it travels."""
        self._raise_fatal()
        if loss_mask is None:
            loss_mask = attention_mask
        validate_micro_batch(input_ids, attention_mask, loss_mask, vocab_size=self.vocab_size,
                             max_length=self.max_length)
        num_tokens = int(attention_mask.sum())
        self._wait_for_room(num_tokens)
        return self._enqueue(ray.put(tuple(t.detach().cpu().numpy()
                                           for t in (input_ids, attention_mask, loss_mask))),
                             num_tokens)

    def _enqueue(self, inputs: ray.ObjectRef, num_tokens: int, **how: Any) -> int:
        micro_batch_id = next(self._ids)
        item = InFlightMicroBatch(micro_batch_id, inputs, num_tokens, **how)
        self._inflight[micro_batch_id] = item
        self._lease(item)
        self.stats["submitted"] += 1
        self.stats["max_inflight"] = max(self.stats["max_inflight"], len(self._inflight))
        return micro_batch_id

    def submit_completion(self, prompts: list[list[int]], sampling: Sampling) -> int:
        """Queue text generation for token-id `prompts` (answer regeneration); `result(id)` then
        returns the generated token lists. Exactly once and retried like supervision."""
        self._raise_fatal()
        validate_prompts(prompts, vocab_size=self.vocab_size, max_length=self.max_length,
                         max_new_tokens=sampling.max_new_tokens)
        num_tokens = sum(map(len, prompts)) + len(prompts) * sampling.max_new_tokens
        self._wait_for_room(num_tokens)
        return self._enqueue(ray.put(([list(p) for p in prompts], dataclasses.asdict(sampling))),
                             num_tokens, method="complete", decode=list)

    def next_result(self) -> tuple[int, Eagle3TargetBatch]:
        """The oldest submitted micro-batch's supervision (blocks until it is ready)."""
        if not self._inflight:
            raise RuntimeError("no micro-batch in flight: submit() before next_result()")
        oldest = next(iter(self._inflight.values()))
        return oldest.micro_batch_id, self.result(oldest.micro_batch_id)

    def result(self, micro_batch_id: int) -> Eagle3TargetBatch:
        """The supervision of one submitted micro-batch; each is delivered exactly once."""
        item = self._inflight.get(micro_batch_id)
        if item is None:
            raise KeyError(f"micro-batch {micro_batch_id} is not in flight (never submitted, or "
                           f"already delivered)")
        started = time.monotonic()
        while not item.done:
            self._pump(timeout=1.0)
            self._raise_fatal()
        self.stats["wait_seconds"] += time.monotonic() - started
        del self._inflight[micro_batch_id]
        if item.error is not None:
            raise item.error
        self.stats["delivered"] += 1
        return item.result

    def stream(self, micro_batches: Iterable[MicroBatch]) -> Iterator[Eagle3TargetBatch]:
        """Supervision for each `(input_ids, attention_mask, loss_mask)`, in order, keeping up
        to the in-flight window submitted ahead (target latency overlaps the caller's work)."""
        source = iter(micro_batches)
        upcoming = next(source, None)  # the next micro-batch, submitted once the window has room
        while True:
            while upcoming is not None and self._has_room(int(upcoming[1].sum())):
                self.submit(*upcoming)
                upcoming = next(source, None)
            if not self._inflight:
                return
            yield self.next_result()[1]

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------------ flow control

    def _has_room(self, num_tokens: int = 0) -> bool:
        tokens = sum(i.num_tokens for i in self._inflight.values())
        return (len(self._inflight) < self.config.max_inflight_micro_batches
                and (not self._inflight
                     or tokens + num_tokens <= self.config.max_inflight_tokens))

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
        self.stats["wait_seconds"] += time.monotonic() - started

    # ------------------------------------------------------------------ the state machine

    def _lease(self, item: InFlightMicroBatch) -> None:
        """Ask the router for a replica, avoiding those this micro-batch already failed on."""
        item.phase = MicroBatchPhase.LEASING
        item.lease_ref = self._router.acquire.remote(
            item.micro_batch_id, item.num_tokens, item.failed_on, self.config.lease_timeout_s,
            self.node_id)

    def _pump(self, timeout: float) -> None:
        """Advance every in-flight micro-batch whose lease or result is ready."""
        now = time.monotonic()
        waiting: dict[ray.ObjectRef, InFlightMicroBatch] = {}
        for item in self._inflight.values():
            if item.phase is MicroBatchPhase.BACKOFF and now >= item.retry_lease_at:
                self._lease(item)
            if item.phase is MicroBatchPhase.RUNNING and now > item.deadline:
                self._attempt_failed(item, f"timed out after {self.config.timeout_s:.0f}s",
                                     replica_died=False, cancel=True)
            if item.phase is MicroBatchPhase.LEASING:
                waiting[item.lease_ref] = item
            elif item.phase is MicroBatchPhase.RUNNING:
                waiting[item.result_ref] = item
        if not waiting:
            time.sleep(min(timeout, ROUTER_RETRY_S))
            return
        ready, _ = ray.wait(list(waiting), num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(list(waiting), num_returns=len(waiting), timeout=0)
        for ref in ready:
            item = waiting[ref]
            if item.phase is MicroBatchPhase.LEASING:
                self._on_lease(item)
            else:
                self._on_result(item)

    def _on_lease(self, item: InFlightMicroBatch) -> None:
        lease_ref, item.lease_ref = item.lease_ref, None
        try:
            replica, handle = ray.get(lease_ref)
        except RayActorError:
            # The router is restarting (or was replaced): ask again shortly.
            logger.warning("router unreachable; retrying lease for micro-batch %d",
                           item.micro_batch_id)
            self.stats["router_retries"] += 1
            item.phase = MicroBatchPhase.BACKOFF
            item.retry_lease_at = time.monotonic() + ROUTER_RETRY_S
            self._reconnect_router()
            return
        except RayTaskError as e:
            cause = e.as_instanceof_cause()
            if isinstance(cause, NoReplicaAvailable):
                item.fail(MicroBatchFailed(str(cause)))
                return
            raise
        item.phase = MicroBatchPhase.RUNNING
        item.replica = replica
        item.attempts += 1
        item.deadline = time.monotonic() + self.config.timeout_s
        item.result_ref = getattr(handle, item.method).remote(item.micro_batch_id, item.inputs)

    def _on_result(self, item: InFlightMicroBatch) -> None:
        try:
            payload = ray.get(item.result_ref, timeout=0)
        except RayActorError as e:
            self._attempt_failed(item, f"replica died ({type(e).__name__})", replica_died=True)
            return
        except RayTaskError as e:
            cause = e.as_instanceof_cause()
            kind = classify(cause)
            if kind is FailureKind.TRANSIENT:
                self._attempt_failed(item, f"{type(cause).__name__}: {cause}",
                                     replica_died=False)
                return
            self._release(item, ok=False)
            item.fail(cause)  # the same on every replica: never re-run
            if kind is FailureKind.CONFIGURATION:
                self._fatal = cause
            return
        except GetTimeoutError:  # not actually ready; look again next round
            return
        self._release(item, ok=True)
        self.stats["served_by"][item.replica] += 1
        if item.replica in item.failed_on:
            self.stats["reruns_on_same_replica"] += 1
        item.succeed(item.decode(payload))

    def _attempt_failed(self, item: InFlightMicroBatch, reason: str, replica_died: bool,
                        cancel: bool = False) -> None:
        """Re-run the micro-batch elsewhere; a late result of this attempt is dropped."""
        if cancel and item.result_ref is not None:
            ray.cancel(item.result_ref)
            self.stats["abandoned_attempts"] += 1
        self._release(item, ok=False, replica_died=replica_died)
        item.failed_on.append(item.replica)
        item.errors.append(f"{item.replica}: {reason}")
        item.result_ref, item.replica = None, None
        if item.attempts >= self.config.max_attempts:
            item.fail(MicroBatchFailed(
                f"micro-batch {item.micro_batch_id} failed {item.attempts} times: "
                + "; ".join(item.errors)))
            return
        logger.warning("micro-batch %d: %s; re-running on another replica",
                       item.micro_batch_id, item.errors[-1])
        self.stats["retries"] += 1
        self._lease(item)

    def _raise_fatal(self) -> None:
        """A configuration error stops the client at once, whichever micro-batch it hit."""
        if self._fatal is not None:
            raise self._fatal

    def _release(self, item: InFlightMicroBatch, ok: bool, replica_died: bool = False) -> None:
        try:
            self._router.release.remote(item.replica, item.num_tokens, ok, replica_died)
        except RayActorError:
            pass  # a restarted router starts counting afresh

    def _reconnect_router(self) -> None:
        if self._router_name is None:
            return
        try:
            self._router = ray.get_actor(self._router_name, namespace=self._namespace)
        except ValueError:
            pass  # not back yet
