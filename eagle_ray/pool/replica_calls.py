"""A client's calls to replicas: micro-batches leased on the same replica at the same moment
travel in one `generate_many` call (one Ray call each way instead of one per micro-batch, and
they merge on the engine anyway), and each reads its own answer from the call's."""

from __future__ import annotations

from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayTaskError

from eagle_ray.pool.inflight import InFlightMicroBatch
from eagle_ray.pool.protocol import Lease, RequestKind

Leased = tuple[InFlightMicroBatch, Lease]  # a micro-batch and the lease it runs on


def group_calls(leased: list[Leased], max_micro_batches: int, max_tokens: int
                ) -> list[list[Leased]]:
    """Replica calls for `leased`: supervision leased on the same replica together, in order,
    up to `max_micro_batches` and `max_tokens` a call (a larger micro-batch alone); anything
    else (text generation) a call each."""
    calls: list[list[Leased]] = []
    open_calls: dict[str, list[Leased]] = {}  # a replica actor's call still taking more
    for item, lease in leased:
        shared = item.kind is RequestKind.SUPERVISION
        call = open_calls.get(lease.actor_id) if shared else None
        if (call is None or len(call) >= max_micro_batches
                or sum(i.num_tokens for i, _ in call) + item.num_tokens > max_tokens):
            call = []
            calls.append(call)
            if shared:
                open_calls[lease.actor_id] = call
        call.append((item, lease))
    return calls


def start(call: list[Leased], deadline: float) -> list[InFlightMicroBatch]:
    """Mark one group of `group_calls` as running on its leases until `deadline` (one
    attempt each); its micro-batches, in order."""
    for index, (item, lease) in enumerate(call):
        item.start(lease, deadline, index if item.kind is RequestKind.SUPERVISION else None)
    return [item for item, _ in call]


def send(handle: ActorHandle, items: list[InFlightMicroBatch]) -> None:
    """Call the replica for `start`ed micro-batches: supervision in one `generate_many`, where
    each reads its answer at its `call_index`; a completion in a `complete` call of its own."""
    if items[0].kind is RequestKind.SUPERVISION:
        ref = handle.generate_many.remote([i.micro_batch_id for i in items],
                                          *[i.inputs for i in items])
    else:
        (item,) = items
        ref = handle.complete.remote(item.micro_batch_id, item.inputs)
    for item in items:
        item.result_ref = ref


def answers(ref: ray.ObjectRef, items: list[InFlightMicroBatch]) -> list[Any]:
    """Each item's answer from its finished call: its result, or the error it raised (an
    error of the whole call is every item's). Raises RayActorError when the replica died and
    GetTimeoutError when the call has not finished."""
    try:
        answer = ray.get(ref, timeout=0)
    except RayTaskError as e:
        return [e.as_instanceof_cause()] * len(items)
    return [answer if item.call_index is None else answer[item.call_index] for item in items]
