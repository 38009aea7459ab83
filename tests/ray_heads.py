"""Ray heads started with `ray start` for one test module, and stopped without touching any
other Ray on the machine (never `ray stop`): free ports everywhere, a temp dir of their own."""

import shutil
import socket
import sys
import uuid
from pathlib import Path

import psutil

from process_tree import descendants

BIN = Path(sys.executable).parent  # the environment's ray / eagle-ray / python


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before by this process: the OS offers a port just
    closed again, and a head given the same port twice fails to start (seen in a full run)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def stop_head(temp_dir: str, gcs_address: str) -> None:
    """Kill the head's processes (their command lines name its temp dir or GCS address) and
    everything they started; other Ray instances on the machine are left alone."""
    own = [p for p in psutil.process_iter(["cmdline"])
           if any(temp_dir in arg or gcs_address in arg for arg in p.info["cmdline"] or [])]
    family = {p.pid: p for p in own}
    for process in own:
        family.update({c.pid: c for c in descendants(process.pid)})
    for process in family.values():
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(family.values()), timeout=30)
    shutil.rmtree(temp_dir, ignore_errors=True)


def short_temp_dir() -> str:
    return f"/tmp/er-{uuid.uuid4().hex[:8]}"  # short: Ray's socket paths must fit 107 bytes


def agent_port_args() -> list[str]:
    """Agent ports with fixed defaults: another Ray on the machine may hold them."""
    return [f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
            f"--metrics-export-port={free_port()}"]
