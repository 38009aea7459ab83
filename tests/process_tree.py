"""A process's descendants found by parent pid alone.

`psutil.Process.children()` drops every child whose wall-clock creation time looks older than
its parent's, and that time moves with the system clock (psutil issues #2542, #2910): on a CI
machine whose clock was stepped, it returned no children for a live engine. Parent pids do not
depend on any clock."""

import psutil


def descendants(pid: int) -> list[psutil.Process]:
    """Every live process below `pid` in the process tree (children, their children, ...)."""
    children: dict[int, list[psutil.Process]] = {}
    for process in psutil.process_iter(["ppid"]):
        children.setdefault(process.info["ppid"], []).append(process)
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child.pid)
    return found
