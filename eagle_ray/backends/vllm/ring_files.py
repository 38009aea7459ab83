"""The files of the shared-memory ring hand-off (`handoff.ShmRingHandoff`): their
names, their size, and the sweep of rings whose owner died. Imports nothing of eagle_ray."""

from __future__ import annotations

import os

SHM_DIR = "/dev/shm"
RING_SUFFIX = "ring"
DEFAULT_CAPACITY = 256 * 2**20  # the smallest ring (`handoff_ring_bytes` sets it outright)
RING_LONGEST_REQUESTS = 2  # a ring holds at least this many requests of max_model_len tokens
RING_SHM_SHARE = 0.25  # ... but takes at most this share of the shared-memory filesystem
TAKEN_SUFFIX = ".taken"  # suffix of a record the runner has taken


def ring_capacity(longest_request_bytes: int, directory: str = SHM_DIR) -> int:
    """Bytes of a ring that holds `RING_LONGEST_REQUESTS` of the longest requests the engine
    accepts (a 4,608-token row of an 8B target in bf16 is 151 MB), at least `DEFAULT_CAPACITY`,
    at most `RING_SHM_SHARE` of the filesystem under `directory`. The file is sparse: pages
    are taken as stretches are first written."""
    wanted = max(DEFAULT_CAPACITY, RING_LONGEST_REQUESTS * longest_request_bytes)
    try:
        stats = os.statvfs(directory)
        wanted = min(wanted, int(stats.f_frsize * stats.f_blocks * RING_SHM_SHARE))
    except OSError:  # no such filesystem yet: the ring's creation will say so
        pass
    return wanted


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
