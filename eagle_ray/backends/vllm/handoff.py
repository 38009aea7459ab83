"""Where the vLLM connector leaves captured hidden states and where the runner picks them up.

Shared by `connector` (writer, inside vLLM's worker) and `runner`
(reader); plain Python and torch, so it imports without vLLM. One class per kind of hand-off,
chosen once where the engine is built (`choose_handoff`); the writer rebuilds the same one from
the plain dictionary it receives through vLLM's `kv_connector_extra_config` (`handoff_from_config`).

- `InProcessHandoff`: a dictionary. Writer and reader share a process (engine core in-process,
  TP = 1), so handing over is a dictionary move.
- `ShmRingHandoff` ("shm", the default across processes): one persistent shared-memory region
  per engine, reused by every request, read as zero-copy views (below).
- `FileHandoff` ("file"): one file per request in a directory. Files are written under a
  temporary name and renamed, so a reader never sees a partial tensor.

The ring: writing each request's states to a fresh tmpfs file pays the kernel's page allocation
every time (2.5x-47x a memcpy on these machines). Instead the runner (reader) creates one file of
`capacity` bytes in /dev/shm when its engine is built; the connector (writer, in vLLM's worker)
maps the same file and copies each request's states into the next free stretch of it, as a ring;
its pages stay allocated, so a publish is one memcpy into warm memory. The writer then publishes
a tiny *record* file `<key>` naming the stretch ("ring OFFSET NBYTES"). `take` renames the
record to `<key>.taken` and returns a zero-copy view of the region; once every tensor viewing it
is dropped the record is deleted, and the writer reuses a stretch once its record is gone. The
ring holds two engine calls' states (`ring_files.ring_capacity`: the call a replica's host stage
reads and the one the engine writes meanwhile). A request that does not fit while the ring is
full goes at once to its own file beside the record ("file NBYTES"): the engine never waits, and
nothing waits with the allocation lock held; the reader counts such overflows (`overflows`,
exported as `eagle_ray_replica_handoff_overflows`). `discard` removes records (and the ring
itself with the engine's key prefix, at shutdown); a ring whose owner process died (a SIGKILLed
replica) is removed by the next engine started on the machine (`sweep_dead_rings`); its name
carries the owner's pid for that.
"""

from __future__ import annotations

import abc
import collections
import mmap
import os
import threading
import weakref
from typing import Any, ClassVar

import numpy as np
import torch

from eagle_ray.backends.vllm.ring_files import (
    DEFAULT_CAPACITY,
    SHM_DIR,
    TAKEN_SUFFIX,
    check_room,
    remove_file,
    ring_capacity,
    ring_name,
    sweep_dead_rings,
)

HANDOFF_KINDS = ("inprocess", "shm", "file")  # what users may ask for (`handoff=`)
PARAMS_KEY = "eagle_ray_hidden_states"  # key in a finished request's kv_transfer_params
# SamplingParams.extra_args flag: False for requests whose states nobody takes (text generation
# through the capturing engine); the connector then saves nothing for them.
CAPTURE_ARG = "eagle_ray_capture"


def handoff_key(engine_tag: str, request_id: str) -> str:
    """Name under which one request's states are published (the tag keeps engines apart)."""
    return f"eagle_ray-{engine_tag}-{request_id}"


def rank_check_key(key: str, rank: int) -> str:
    """Name under which TP rank `rank` (> 0) publishes its own copy of one captured row of the
    request published under `key`, for the runner to compare with rank 0's (`discard(key)`
    drops it too)."""
    return f"{key}@rank{rank}"


class Handoff(abc.ABC):
    """A place the connector publishes `[num_tokens, num_ids, H]` states to, keyed by request."""

    kind: ClassVar[str]
    overflows: int = 0  # requests that found the ring full and came through a file (ShmRing)

    @abc.abstractmethod
    def publish(self, key: str, states: torch.Tensor) -> None:
        """Make `states` (on CPU, complete) readable under `key`. Called by the connector."""

    @abc.abstractmethod
    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        """Remove and return what was published under `key`, or None if it is not there yet.

        Called by the runner, which knows `shape` and `dtype` (it configured the capture).
        """

    @abc.abstractmethod
    def discard(self, prefix: str) -> int:
        """Drop everything published under keys starting with `prefix`; returns how many.

        Called by the runner when a call fails and when it shuts down, so nothing leaks.
        """

    @abc.abstractmethod
    def to_config(self) -> dict[str, Any]:
        """Plain, JSON-able description; `handoff_from_config` rebuilds the same hand-off."""


class InProcessHandoff(Handoff):
    """A process-wide dictionary: every instance in one process sees the same entries."""

    kind = "inprocess"
    _entries: ClassVar[dict[str, torch.Tensor]] = {}  # key -> [num_tokens, num_ids, H]
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def publish(self, key: str, states: torch.Tensor) -> None:
        with self._lock:
            self._entries[key] = states

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        with self._lock:
            return self._entries.pop(key, None)

    def discard(self, prefix: str) -> int:
        with self._lock:
            stale = [k for k in self._entries if k.startswith(prefix)]
            for k in stale:
                del self._entries[k]
        return len(stale)

    def keys(self, prefix: str = "") -> list[str]:
        """Published keys not yet taken (what a leak check looks at)."""
        with self._lock:
            return [k for k in self._entries if k.startswith(prefix)]

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind}


class FileHandoff(Handoff):
    """One raw file per request under `directory` (`/dev/shm` keeps it in RAM)."""

    kind = "file"

    def __init__(self, directory: str = SHM_DIR) -> None:
        self.directory = directory

    def publish(self, key: str, states: torch.Tensor) -> None:
        os.makedirs(self.directory, exist_ok=True)
        path = os.path.join(self.directory, key)
        partial = path + ".partial"
        # Raw bytes (viewed as uint8, so bf16 needs no numpy dtype).
        states.contiguous().view(torch.uint8).numpy().tofile(partial)
        os.rename(partial, path)

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        path = os.path.join(self.directory, key)
        try:
            raw = np.fromfile(path, dtype=np.uint8)
        except FileNotFoundError:
            return None
        os.unlink(path)
        return torch.from_numpy(raw).view(dtype).reshape(shape)

    def discard(self, prefix: str) -> int:
        return sum(self._unlink(name) for name in self.keys(prefix))

    def keys(self, prefix: str = "") -> list[str]:
        """Files under `directory` starting with `prefix` (published or half-written)."""
        if not os.path.isdir(self.directory):
            return []
        return [name for name in os.listdir(self.directory) if name.startswith(prefix)]

    def _unlink(self, name: str) -> bool:
        return remove_file(os.path.join(self.directory, name))

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self.directory}


class ShmRingHandoff(Handoff):
    """The ring (module docstring). `create=True`: the runner makes the file; the connector maps
    it from `to_config()`."""

    kind = "shm"

    def __init__(self, path: str, capacity: int = DEFAULT_CAPACITY, create: bool = False) -> None:
        self.path, self.capacity = path, capacity
        self.directory = os.path.dirname(path)
        if create:
            with open(path, "wb") as f:
                f.truncate(capacity)
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), capacity)
        self._buffer = np.frombuffer(self._map, dtype=np.uint8)
        # Writer state: live stretches in allocation order (offset, nbytes, key) and the head.
        self._live: collections.deque[tuple[int, int, str]] = collections.deque()
        self._copying: set[str] = set()  # keys whose stretch is being written (no record yet)
        self._head = 0
        self._lock = threading.Lock()  # guards the writer state, not the copies
        # Reader state: requests that found the ring full and came through a file of their own
        # (counted where they are taken: the writer runs in vLLM's worker process).
        self.overflows = 0
        self.overflow_bytes = 0

    # ---------------------------------------------------------------- writer (the connector)

    def publish(self, key: str, states: torch.Tensor) -> None:
        raw = states.contiguous().view(torch.uint8).reshape(-1)
        nbytes = raw.numel()
        with self._lock:  # only the allocation: writers copy side by side
            self._reclaim()
            offset = self._fit(nbytes) if nbytes <= self.capacity else None
            if offset is not None:
                self._head = offset + nbytes
                self._live.append((offset, nbytes, key))
                self._copying.add(key)
        if offset is not None:
            torch.from_numpy(self._buffer[offset:offset + nbytes]).copy_(raw)  # threaded
            record = f"ring {offset} {nbytes}"
        else:  # full (or larger than the ring): a file of its own, never a wait
            raw.numpy().tofile(self._record_path(key) + ".data")
            record = f"file {nbytes}"
        partial = self._record_path(key) + ".partial"
        with open(partial, "w") as f:
            f.write(record)
        os.rename(partial, self._record_path(key))
        with self._lock:
            self._copying.discard(key)  # the record now keeps the stretch live

    def _fit(self, nbytes: int) -> int | None:
        if not self._live:
            self._head = 0
            return 0
        tail = self._live[0][0]
        if self._head > tail:  # free: [head, capacity) and [0, tail)
            if self.capacity - self._head >= nbytes:
                return self._head
            return 0 if tail >= nbytes else None
        return self._head if tail - self._head >= nbytes else None  # free: [head, tail)

    def _reclaim(self) -> None:
        while self._live and not self._is_live(self._live[0][2]):
            self._live.popleft()

    def _is_live(self, key: str) -> bool:
        if key in self._copying:
            return True
        record = self._record_path(key)
        return os.path.exists(record) or os.path.exists(record + TAKEN_SUFFIX)

    # ---------------------------------------------------------------- reader (the runner)

    def take(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
        record = self._record_path(key)
        try:
            os.rename(record, record + TAKEN_SUFFIX)
        except FileNotFoundError:
            return None
        with open(record + TAKEN_SUFFIX) as f:
            kind, *numbers = f.read().split()
        if kind == "file":
            raw = np.fromfile(record + ".data", dtype=np.uint8)
            self.overflows += 1
            self.overflow_bytes += raw.nbytes
            remove_file(record + ".data")
            remove_file(record + TAKEN_SUFFIX)
            return torch.from_numpy(raw).view(dtype).reshape(shape)
        offset, nbytes = map(int, numbers)
        stretch = self._buffer[offset:offset + nbytes]
        # The stretch is the writer's again once the caller drops every tensor viewing it (they
        # all hold `stretch` through their storage).
        weakref.finalize(stretch, remove_file, record + TAKEN_SUFFIX)
        return torch.from_numpy(stretch).view(dtype).reshape(shape)

    def discard(self, prefix: str) -> int:
        names = self.keys(prefix)
        for name in names:
            remove_file(os.path.join(self.directory, name))
        return len(names)

    def keys(self, prefix: str = "") -> list[str]:
        """Records, taken records, overflow files (and the ring) starting with `prefix`."""
        return [n for n in os.listdir(self.directory) if n.startswith(prefix)]

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "capacity": self.capacity}

    def _record_path(self, key: str) -> str:
        return os.path.join(self.directory, key)


def rank_check_handoff(handoff: Handoff) -> FileHandoff:
    """Where TP ranks past the first publish their rank check's rows (`rank_check_key`): a file
    each, beside `handoff`'s own records (a shared-memory ring has one writer, rank 0)."""
    return FileHandoff(getattr(handoff, "directory", SHM_DIR))


def choose_handoff(kind: str | None, *, same_process: bool, key_prefix: str,
                   directory: str | None = None, ring_bytes: int | None = None,
                   call_bytes: int = 0, object_store_bytes: int = 0) -> Handoff:
    """The hand-off for an engine: `kind` as the user asked ("inprocess", "shm", "file"), or the
    cheapest that works when None. `same_process`: the engine's only worker runs in this process.
    A new "shm" ring is named after `key_prefix` (the engine's keys) and this process, holds
    two engine calls of `call_bytes` (`ring_capacity`) unless `ring_bytes` says otherwise, and is
    refused when it would not fit beside an object store of `object_store_bytes`
    (`check_room`); rings of dead processes are swept first.
    """
    kind = kind or ("inprocess" if same_process else "shm")
    if kind not in HANDOFF_KINDS:
        raise ValueError(f"unknown handoff {kind!r}; choose one of {HANDOFF_KINDS}")
    if kind == "inprocess":
        if not same_process:
            raise ValueError("handoff='inprocess' needs the engine core and its only worker in "
                             "this process (multiprocess=False, tp_size=1); use 'shm'")
        return InProcessHandoff()
    if kind == "file":
        if not directory:
            raise ValueError("handoff='file' needs handoff_dir (a directory to write into)")
        return FileHandoff(directory)
    directory = directory or SHM_DIR
    sweep_dead_rings(directory)
    capacity = ring_bytes or ring_capacity(call_bytes)
    check_room(capacity, object_store_bytes, directory)
    return ShmRingHandoff(os.path.join(directory, ring_name(key_prefix)), capacity,
                          create=True)


def handoff_from_config(config: dict[str, Any]) -> Handoff:
    """Inverse of `Handoff.to_config` (the connector's side)."""
    if config["kind"] == InProcessHandoff.kind:
        return InProcessHandoff()
    if config["kind"] == ShmRingHandoff.kind:
        return ShmRingHandoff(config["path"], config["capacity"])
    return FileHandoff(config["directory"])
