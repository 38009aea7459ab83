"""Benchmark results kept as files: `eagle-ray bench NAME --save` writes the run's JSON lines to
`benchmarks/results/NAME/`, each line carrying the commit, the machine and the date it ran on, so
a published figure can be traced to a run (docs/benchmarks.md is generated from these files by
`eagle_ray.bench.tables`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("benchmarks/results")


def machine() -> dict[str, Any]:
    """Cores, CPU model, memory and GPU of this machine (what a figure depends on)."""
    info: dict[str, Any] = {"cores": os.cpu_count(), "cpu": platform.processor() or "unknown",
                            "memory_gib": None, "gpu": None}
    cpuinfo, meminfo = Path("/proc/cpuinfo"), Path("/proc/meminfo")
    if cpuinfo.exists():
        models = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                  if line.startswith("model name")]
        info["cpu"] = models[0] if models else info["cpu"]
    if meminfo.exists():
        kib = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        info["memory_gib"] = round(kib / 2**20, 1)
    torch = sys.modules.get("torch")  # a benchmark that used a GPU has imported torch
    if torch is not None and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def commit() -> str:
    """The checkout's commit (`-dirty` with uncommitted changes to tracked files), or `unknown`
    outside a git checkout."""
    source = Path(__file__).resolve().parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=source, capture_output=True, text=True)

    head = git("rev-parse", "--short=12", "HEAD")
    if head.returncode != 0:
        return "unknown"
    dirty = git("diff", "--quiet", "HEAD").returncode != 0
    return head.stdout.strip() + ("-dirty" if dirty else "")


def save(which: str, records: list[dict[str, Any]], options: dict[str, Any],
         directory: Path = RESULTS_DIR) -> Path:
    """Write one run's `records` to a new file under `directory/which/` and return its path.
    Runs published in the repository's results must come from committed code, so a reader can
    check out what measured them: a checkout with uncommitted changes is refused there."""
    now = datetime.datetime.now(datetime.UTC)
    run = {"commit": commit(), "machine": machine(), "date": now.isoformat(timespec="seconds"),
           "options": options}
    if run["commit"].endswith("-dirty") and Path(directory).resolve() == RESULTS_DIR.resolve():
        raise ValueError(f"bench {which}: not saved to {RESULTS_DIR}: the checkout has "
                         f"uncommitted changes ({run['commit']}); commit them (or stash them) "
                         f"and run the benchmark again, or save elsewhere with --save DIR")
    folder = Path(directory) / which
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{now:%Y%m%dT%H%M%S.%f}-{run['commit']}.jsonl"
    with path.open("x") as f:  # never overwrite a run
        for record in records:
            f.write(json.dumps({**record, **run}) + "\n")
    return path


def load(directory: Path = RESULTS_DIR) -> dict[str, list[list[dict[str, Any]]]]:
    """Every saved run under `directory`, by benchmark: {name: [run's records, ...]} oldest first;
    quick runs (CI's smallest sizes) are not results and are left out."""
    runs: dict[str, list[list[dict[str, Any]]]] = {}
    for path in sorted(Path(directory).glob("*/*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if records and not records[0]["options"].get("quick"):
            runs.setdefault(path.parent.name, []).append(records)
    return runs
