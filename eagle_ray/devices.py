"""Moving tensors between an engine's device and host memory, waited for by construction
(docs/contract.md, "Where tensors live").

Every copy in eagle_ray whose result the host or another stream reads goes through here (a test
keeps it so: no other module issues a non-blocking copy). A non-blocking GPU-to-host copy writes
pinned host memory and returns before its bytes arrive; reading that memory before the copy's
stream has reached it reads stale data, which no CPU test and no fake tensor can show. So:

- `hand_over` returns only usable tensors: copies are issued non-blocking (each device-to-host
  copy lands in pinned memory, so the copies of a batch overlap one another and the work still
  queued), then one event recorded behind them on each source stream is waited for (an event per
  hop, not a device-wide sync). Host-to-device copies run in the destination's stream order, so
  work queued after them on that stream sees them; only pinned sources are copied
  asynchronously (a pageable one is staged by the driver anyway).
- `start_hand_over` issues the copies on a side stream and returns a `HandOver`, whose
  `result()` waits for them (the host for a device-to-host copy; the consumer's stream, not the
  host, for a host-to-device one): the prefetch of the next training batch, the vLLM connector's
  copies around its gather (the slots in, the states out of the KV cache).

`HostBuffers` keeps the host memory that supervision is written into, for the next batch: a
fresh 512 MiB allocation costs its page faults every time (3.4x a copy into warm memory here).
A host-to-device copy out of it is non-blocking too, so the memory may still be read after the
call that filled it has returned: each use records an event behind the copies it enqueued, and
the host waits for it before the memory is handed out again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

# `empty(shape, dtype)`: an uninitialised host tensor (what a `HostBuffers` use hands out).
EmptyHost = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def hand_over(tensors: Iterable[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """The tensors on `device`, every copy landed (tensors already there are not copied).

    `tensors` may be a generator: each copy is issued as its tensor is produced (chunked
    decoding frees each chunk on the GPU once its copy is queued), and one wait covers them all.
    """
    device = torch.device(device)
    moved, sources = [], set()
    for tensor in tensors:
        copied = tensor.to(device, non_blocking=_may_copy_async(tensor, device))
        if copied is not tensor:
            sources.add(tensor.device)
        moved.append(copied)
    if device.type == "cpu":
        for source in sources:
            if _real_gpu(source):
                _wait_on_host(torch.cuda.current_stream(source))
    return moved


def to_device(tensors: dict[str, torch.Tensor], device: torch.device | str
              ) -> dict[str, torch.Tensor]:
    """`hand_over` for a batch's named tensors."""
    return dict(zip(tensors, hand_over(tensors.values(), device), strict=True))


class HandOver:
    """Copies issued on a side stream (`start_hand_over`); `result()` makes them usable,
    `query()` says whether they have landed."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device,
                 event: torch.cuda.Event | None) -> None:
        self._tensors, self._device, self._event = tensors, device, event

    def query(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[torch.Tensor]:
        """The copies, safe to read: on the host once the event has fired (device-to-host);
        on the GPU, with the current stream ordered after the copies and the memory marked as
        used by it (host-to-device), so the host does not wait."""
        if self._event is None:
            return self._tensors
        if self._device.type == "cpu":
            self._event.synchronize()
            return self._tensors
        consumer = torch.cuda.current_stream(self._device)
        consumer.wait_event(self._event)
        for tensor in self._tensors:
            tensor.record_stream(consumer)  # allocated on the side stream, used on this one
        return self._tensors


def start_hand_over(tensors: Iterable[torch.Tensor], device: torch.device | str,
                    stream: torch.cuda.Stream | None) -> HandOver:
    """Copy `tensors` to `device` on `stream` (a side stream of the GPU involved) without
    waiting; host sources are pinned first so the copy is asynchronous. With no stream (no real
    GPU in the hop) the copies are made at once."""
    device = torch.device(device)
    tensors = list(tensors)
    if stream is None:
        return HandOver(hand_over(tensors, device), device, None)
    if device.type != "cpu":
        tensors = [t if t.is_pinned() else t.pin_memory() for t in tensors]
    ready = torch.cuda.Event()
    ready.record()  # the side stream starts after what the current stream has queued
    stream.wait_event(ready)
    with torch.cuda.stream(stream):
        moved = [t.to(device, non_blocking=True) for t in tensors]
    for tensor in tensors:
        if tensor.is_cuda:  # read on the side stream: not reused before the copy is done
            tensor.record_stream(stream)
    event = torch.cuda.Event()
    event.record(stream)
    return HandOver(moved, device, event)


@dataclasses.dataclass(eq=False)  # one buffer is itself only (and arrays compare elementwise)
class _Buffer:
    """Host memory `HostBuffers` keeps, and the events behind the GPU copies of its last use."""

    memory: np.ndarray  # uint8
    reads: list[torch.cuda.Event] = dataclasses.field(default_factory=list)

    def wait(self) -> None:
        """Block the host until the last use's copies have read the memory."""
        for event in self.reads:
            event.synchronize()
        self.reads = []


class HostBuffers:
    """Host memory reused across calls: `use` hands out tensors backed by idle buffers (or new
    ones). A buffer is idle again once every tensor and array viewing it is gone (after Ray has
    copied a replica's answer into the object store, say) and the GPU copies that read it have
    finished. Pinned where a GPU is present, so copies to it are asynchronous. At most
    `max_buffers` are kept; beyond them tensors are allocated as usual."""

    def __init__(self, max_buffers: int = 8) -> None:
        self.max_buffers = max_buffers
        self._pinned = torch.cuda.is_available()
        self._idle: list[_Buffer] = []  # buffers nothing views now
        self._kept = 0  # buffers made (idle or in use)
        # A replica's host stage and its request threads. Reentrant: a view's finalizer
        # (`_release`) may run in a garbage collection that an allocation under the lock set off.
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def use(self, readers: Iterable[torch.device | str] = ()) -> Iterator[EmptyHost]:
        """`empty(shape, dtype)` for one call: uninitialised host tensors that the GPUs among
        `readers` may copy from without the host waiting. On exit (every copy of the call
        enqueued) an event is recorded behind what each reader's current stream has queued; the
        memory is handed out again only once the host has waited for it."""
        taken: list[tuple[_Buffer, np.ndarray]] = []  # viewed until their reads are fenced

        def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            nbytes = math.prod(shape) * dtype.itemsize
            buffer = self._take(nbytes)
            if buffer is None:
                return torch.empty(shape, dtype=dtype)
            view = buffer.memory[:nbytes]  # every tensor handed out keeps this array alive
            weakref.finalize(view, self._release, buffer)
            taken.append((buffer, view))
            return torch.from_numpy(view).view(dtype).reshape(shape)

        try:
            yield empty
        finally:
            reads = _reads_of(readers) if taken else []
            for buffer, _ in taken:
                buffer.reads = reads
            taken.clear()

    def _take(self, nbytes: int) -> _Buffer | None:
        """The smallest idle buffer of at least `nbytes`, its last use's copies waited for; a new
        one while fewer than `max_buffers` exist; else None."""
        with self._lock:
            fitting = [b for b in self._idle if b.memory.nbytes >= nbytes]
            if fitting:
                buffer = min(fitting, key=lambda b: b.memory.nbytes)
                self._idle.remove(buffer)
            elif self._kept < self.max_buffers:
                self._kept += 1
                return _Buffer(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
                               if self._pinned else np.empty(nbytes, dtype=np.uint8))
            else:
                return None
        buffer.wait()  # outside the lock: other calls take other buffers meanwhile
        return buffer

    def _release(self, buffer: _Buffer) -> None:
        with self._lock:
            self._idle.append(buffer)


def _may_copy_async(tensor: torch.Tensor, device: torch.device) -> bool:
    if device.type == "cpu":
        return _real_gpu(tensor.device)  # into pinned memory, waited for in `hand_over`
    return _real_gpu(device) and tensor.device.type == "cpu" and tensor.is_pinned()


def _wait_on_host(stream: torch.cuda.Stream) -> None:
    """Block the host until the work queued on `stream` so far is done (an event behind it:
    later work on the stream, or on other streams, is not waited for)."""
    _event_behind(stream).synchronize()


def _reads_of(readers: Iterable[torch.device | str]) -> list[torch.cuda.Event]:
    """An event behind the work queued so far on the current stream of each real GPU among
    `readers` (where their copies of a `HostBuffers` use were enqueued)."""
    gpus = {torch.device(reader) for reader in readers}
    return [_event_behind(torch.cuda.current_stream(gpu)) for gpu in gpus if _real_gpu(gpu)]


def _event_behind(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _real_gpu(device: torch.device) -> bool:
    # False for fake "cuda" tensors on a CPU-only build (the device tests): nothing to wait for.
    return device.type == "cuda" and torch.cuda.is_available()
