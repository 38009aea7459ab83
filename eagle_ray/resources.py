"""Will the job ever fit the cluster? Checked before anything is created.

A job asks Ray for the pool's replica placement groups and the trainer's workers. If the cluster
cannot hold them even when idle -- a GPU asked of a CPU cluster, a misspelt custom resource, five
workers on two CPUs -- Ray would wait forever, and Ray Train would log a startup timeout every
minute. So the job adds up what it will ask for and compares it with what the cluster could ever
offer: its nodes' totals plus the node types an autoscaler may launch (Ray publishes them in the
GCS when an autoscaler runs). What can never fit is an error naming the resource, how much is
asked and how much exists, and the config keys to change. What only has to wait (resources in
use, or nodes an autoscaler can add) is logged and left to Ray.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
from collections.abc import Iterable

from eagle_ray.config import ConfigError, JobConfig

logger = logging.getLogger(__name__)

Resources = dict[str, float]
EPSILON = 1e-9


class ResourcesNeverFit(ConfigError):
    """The job asks for more than the cluster could ever offer; the message says what to change."""


@dataclasses.dataclass(frozen=True)
class Demand:
    """One unit Ray must place on a single node: a replica's placement group (its TP bundles,
    packed), or one trainer worker."""

    what: str
    resources: Resources
    keys: str  # the config keys that set it


@dataclasses.dataclass(frozen=True)
class Capacity:
    """What the cluster has (`nodes`: totals of alive nodes; `free`: available now) and what an
    autoscaler may add (`node_types`: resources of one node, how many at most)."""

    nodes: list[Resources]
    free: Resources
    node_types: list[tuple[Resources, int]]


def job_demands(config: JobConfig, with_pool: bool = True) -> list[Demand]:
    """What `config` will ask Ray for: the replicas it starts (none when it joins a shared pool
    or, `with_pool=False`, reads a supervision cache) and the trainer's workers."""
    from eagle_ray.pool.placement import replica_bundle

    demands = []
    if with_pool and not config.use_shared_pool:
        demands += [Demand(f"target replica {i}", replica_bundle(config.target),
                           "target.tp_size / cpus_per_bundle / use_gpu / bundle_resources")
                    for i in range(config.target.initial_replicas)]
    train = config.train
    worker = {"CPU": train.cpus_per_worker, **({"GPU": 1.0} if train.use_gpu else {}),
              **train.worker_resources}
    demands += [Demand(f"trainer worker {i}", worker,
                       "train.workers / cpus_per_worker / use_gpu / worker_resources")
                for i in range(train.workers)]
    # Ray Data reads, tokenises (actors) and filters while the workers train.
    tasks = 2 + config.data.tokenize_workers
    demands.append(Demand("data ingest", {"CPU": tasks * config.data.cpus_per_task},
                          "data.cpus_per_task / tokenize_workers"))
    return demands


def cluster_capacity() -> Capacity:
    """The running cluster's nodes, free resources and autoscaler node types."""
    import ray

    from eagle_ray.ray_compat import autoscaler_node_groups

    nodes = [dict(n["Resources"]) for n in ray.nodes() if n["Alive"]]
    node_types = [(resources, count if count >= 0 else 10**6)
                  for resources, count in autoscaler_node_groups()]
    return Capacity(nodes, dict(ray.available_resources()), node_types)


def never_fit(demands: Iterable[Demand], capacity: Capacity) -> list[str]:
    """Why the demands can never be placed (empty when they can, at least in total)."""
    demands = list(demands)
    shapes = capacity.nodes + [resources for resources, count in capacity.node_types if count]
    problems = []
    for resource in sorted({r for d in demands for r in d.resources}):
        if not any(shape.get(resource, 0) > 0 for shape in shapes):
            keys = next(d.keys for d in demands if resource in d.resources)
            problems.append(f"resource {resource!r} exists nowhere in this cluster (its nodes "
                            f"and node types offer {sorted(_names(shapes))}); check {keys}")
    if problems:
        return problems
    for demand in demands:
        if not any(_fits(demand.resources, shape) for shape in shapes):
            biggest = {r: max(shape.get(r, 0) for shape in shapes) for r in demand.resources}
            problems.append(f"{demand.what} needs {_show(demand.resources)} on one node, but the "
                            f"largest node offers {_show(biggest)}; change {demand.keys}")
            break  # one line per kind of unit is enough
    asked = _total(d.resources for d in demands)
    offered = _total(capacity.nodes + [{r: v * count for r, v in resources.items()}
                                       for resources, count in capacity.node_types])
    for resource, amount in sorted(asked.items()):
        if amount > offered.get(resource, 0) + EPSILON:
            parts = collections.Counter(d.keys for d in demands if resource in d.resources)
            problems.append(f"the job asks for {amount:g} {resource} in all (replicas, "
                            f"trainer workers, data ingest) but the cluster could offer "
                            f"{offered.get(resource, 0):g}; lower {' or '.join(sorted(parts))}")
    return problems


def check_job_resources(config: JobConfig, with_pool: bool = True) -> None:
    """Raise `ResourcesNeverFit` when the job can never run here; log what it will wait for."""
    demands = job_demands(config, with_pool)
    capacity = cluster_capacity()
    problems = never_fit(demands, capacity)
    if problems:
        raise ResourcesNeverFit("this job can never be scheduled on this cluster: "
                                + "; ".join(problems))
    asked = _total(d.resources for d in demands)
    short = {r: (a, capacity.free.get(r, 0)) for r, a in asked.items()
             if a > capacity.free.get(r, 0) + EPSILON}
    if short:
        logger.warning("waiting for resources: the job needs %s, free now %s (in use%s)",
                       _show({r: a for r, (a, _) in short.items()}),
                       _show({r: f for r, (_, f) in short.items()}),
                       "; an autoscaler may add nodes" if capacity.node_types else "")


def _fits(needed: Resources, node: Resources) -> bool:
    return all(node.get(r, 0) + EPSILON >= amount for r, amount in needed.items())


def _total(bundles: Iterable[Resources]) -> Resources:
    total: Resources = collections.defaultdict(float)
    for bundle in bundles:
        for resource, amount in bundle.items():
            total[resource] += amount
    return dict(total)


def _names(shapes: list[Resources]) -> set[str]:
    return {r for shape in shapes for r in shape if not r.startswith("node:")
            and "memory" not in r and not r.startswith("accelerator_type")}


def _show(resources: Resources) -> str:
    return "{" + ", ".join(f"{r}: {v:g}" for r, v in sorted(resources.items())) + "}"
