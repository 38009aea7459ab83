"""Where the vLLM connector leaves captured hidden states and where the runner picks them up.

Shared by `eagle_ray.vllm_connector` (writer, inside vLLM's worker) and `eagle_ray.vllm_runner`
(reader); plain Python and torch, so it imports without vLLM. Modes: "inprocess" (a dictionary;
writer and reader share a process), "shm" (files in `/dev/shm`, i.e. RAM), "file" (a directory
of the user's choice). Files are written under a temporary name and renamed, so a reader never
sees a partial tensor.
"""

from __future__ import annotations

import os
import threading

import numpy as np
import torch

HANDOFF_MODES = ("inprocess", "shm", "file")
SHM_DIR = "/dev/shm"

PARAMS_KEY = "eagle_ray_hidden_states"  # key in a finished request's kv_transfer_params

_INPROCESS: dict[str, torch.Tensor] = {}  # key -> [num_tokens, num_ids, H]
_INPROCESS_LOCK = threading.Lock()


def handoff_key(engine_tag: str, request_id: str) -> str:
    return f"eagle_ray-{engine_tag}-{request_id}"


def publish(mode: str, directory: str, key: str, states: torch.Tensor) -> None:
    """Make `states` (on CPU, complete) readable under `key`; called by the connector."""
    if mode == "inprocess":
        with _INPROCESS_LOCK:
            _INPROCESS[key] = states
        return
    path = os.path.join(directory, key)
    partial = path + ".partial"
    # Raw bytes (viewed as uint8, so bf16 needs no numpy dtype).
    states.contiguous().view(torch.uint8).numpy().tofile(partial)
    os.rename(partial, path)


def take(mode: str, directory: str, key: str, shape: tuple[int, ...],
         dtype: torch.dtype) -> torch.Tensor | None:
    """Remove and return what was published under `key`, or None if it is not there yet.

    The reader knows `shape` and `dtype`: it configured the model and the captured ids.
    """
    if mode == "inprocess":
        with _INPROCESS_LOCK:
            return _INPROCESS.pop(key, None)
    path = os.path.join(directory, key)
    try:
        raw = np.fromfile(path, dtype=np.uint8)
    except FileNotFoundError:
        return None
    os.unlink(path)
    return torch.from_numpy(raw).view(dtype).reshape(shape)


def discard(mode: str, directory: str, prefix: str) -> int:
    """Drop everything published under keys starting with `prefix` (engine shutdown, errors)."""
    if mode == "inprocess":
        with _INPROCESS_LOCK:
            stale = [k for k in _INPROCESS if k.startswith(prefix)]
            for k in stale:
                del _INPROCESS[k]
        return len(stale)
    removed = 0
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(prefix):
                try:
                    os.unlink(os.path.join(directory, name))
                    removed += 1
                except FileNotFoundError:
                    pass
    return removed
