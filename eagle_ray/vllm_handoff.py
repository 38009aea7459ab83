"""Where the vLLM connector leaves captured hidden states and where the runner picks them up.

Shared by `eagle_ray.vllm_connector` (writer, inside vLLM's worker) and `eagle_ray.vllm_runner`
(reader); plain Python and torch, so it imports without vLLM. One class per kind of hand-off,
chosen once where the engine is built (`choose_handoff`); the writer rebuilds the same one from
the plain dictionary it receives through vLLM's `kv_connector_extra_config` (`handoff_from_config`).

- `InProcessHandoff`: a dictionary. Writer and reader share a process (engine core in-process,
  TP = 1), so handing over is a dictionary move.
- `FileHandoff`: one file per request in a directory, `/dev/shm` (RAM) by default. Files are
  written under a temporary name and renamed, so a reader never sees a partial tensor.
"""

from __future__ import annotations

import abc
import os
import threading
from typing import Any, ClassVar

import numpy as np
import torch

SHM_DIR = "/dev/shm"
HANDOFF_KINDS = ("inprocess", "shm", "file")  # what users may ask for (`handoff=`)
PARAMS_KEY = "eagle_ray_hidden_states"  # key in a finished request's kv_transfer_params
# SamplingParams.extra_args flag: False for requests whose states nobody takes (text generation
# through the capturing engine); the connector then saves nothing for them.
CAPTURE_ARG = "eagle_ray_capture"


def handoff_key(engine_tag: str, request_id: str) -> str:
    """Name under which one request's states are published (the tag keeps engines apart)."""
    return f"eagle_ray-{engine_tag}-{request_id}"


class Handoff(abc.ABC):
    """A place the connector publishes `[num_tokens, num_ids, H]` states to, keyed by request."""

    kind: ClassVar[str]

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
        try:
            os.unlink(os.path.join(self.directory, name))
            return True
        except FileNotFoundError:
            return False

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind, "directory": self.directory}


def choose_handoff(kind: str | None, *, same_process: bool,
                   directory: str | None = None) -> Handoff:
    """The hand-off for an engine: `kind` as the user asked ("inprocess", "shm", "file"), or the
    cheapest that works when None. `same_process`: the engine's only worker runs in this process.
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
    return FileHandoff(directory or SHM_DIR)


def handoff_from_config(config: dict[str, Any]) -> Handoff:
    """Inverse of `Handoff.to_config` (the connector's side)."""
    if config["kind"] == InProcessHandoff.kind:
        return InProcessHandoff()
    return FileHandoff(config["directory"])
