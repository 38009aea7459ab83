"""The files of the shared-memory ring hand-off (`handoff.ShmRingHandoff`): their
names, their size, and the sweep of rings whose owner died. Imports nothing of eagle_ray."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
RING_SUFFIX = "ring"
DEFAULT_CAPACITY = 256 * 2**20  # the smallest ring (`handoff_ring_bytes` sets it outright)
# A ring holds this many engine calls' captured states: the one the replica's host stage reads
# and the one the engine writes meanwhile (`pool/engine_queue.py` never lets a third wait).
RING_ENGINE_CALLS = 2
TAKEN_SUFFIX = ".taken"  # suffix of a record the runner has taken


def ring_capacity(call_bytes: int) -> int:
    """Bytes of a ring that holds `RING_ENGINE_CALLS` engine calls of `call_bytes` captured
    states each (an 8B target's 16,384-token call: 512 MiB), at least `DEFAULT_CAPACITY`. The
    file is sparse: pages are taken as stretches are first written."""
    return max(DEFAULT_CAPACITY, RING_ENGINE_CALLS * call_bytes)


def check_room(ring_bytes: int, object_store_bytes: int, directory: str = SHM_DIR) -> None:
    """Refuse a ring that would not fit beside the Ray object store in `directory`'s
    filesystem (Ray keeps the store in /dev/shm when it fits there): a shared-memory filesystem
    written past its size kills the writer with SIGBUS, mid-call."""
    stats = os.statvfs(directory)
    total, free = stats.f_frsize * stats.f_blocks, stats.f_frsize * stats.f_bavail
    store = object_store_bytes if object_store_bytes <= total else 0  # else Ray uses /tmp
    if ring_bytes <= free and ring_bytes + store <= total:
        return
    raise ValueError(
        f"the vLLM hand-off ring needs {ring_bytes / 2**30:.2f} GiB of {directory} beside the "
        f"Ray object store's {store / 2**30:.2f} GiB, but {directory} holds "
        f"{total / 2**30:.2f} GiB ({free / 2**30:.2f} GiB free): lower "
        f"target.max_tokens_per_engine_call (the ring holds {RING_ENGINE_CALLS} engine calls' "
        f"captured states) or set target.backend_kwargs.handoff_ring_bytes, give the object "
        f"store less (ray start --object-store-memory), or give the node more shared memory "
        f"(docker --shm-size; on Kubernetes an emptyDir with medium: Memory on /dev/shm)")


def ring_name(key_prefix: str, pid: int | None = None) -> str:
    """`<key_prefix>ring.<owner pid>`: the engine's keys' prefix, so `discard(prefix)` removes
    it with them."""
    return f"{key_prefix}{RING_SUFFIX}.{pid or os.getpid()}"


def sweep_dead_rings(directory: str = SHM_DIR) -> list[str]:
    """Remove the rings (and records) of engines whose owner process is gone; their names."""
    removed = []
    for name in os.listdir(directory) if os.path.isdir(directory) else []:
        if not name.startswith("eagle_ray-") or f"-{RING_SUFFIX}." not in name:
            continue
        prefix, _, pid = name.rpartition(".")
        if pid.isdigit() and not _alive(int(pid)):
            prefix = prefix.removesuffix(RING_SUFFIX)
            for stale in os.listdir(directory):
                if stale.startswith(prefix):
                    remove_file(os.path.join(directory, stale))
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        pass
    return True


def remove_file(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False
