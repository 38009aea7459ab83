"""Starting, killing and finding a pool's replicas: actors in their own placement groups. Shared
by `TargetPool` (a person's or a job's calls) and the autoscaling controller, so both change the
pool the same way; each registers with and drains through the router itself."""

from __future__ import annotations

import functools
import logging

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, remove_placement_group

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.placement import create_replica_placement_group, replica_actor_options

logger = logging.getLogger(__name__)


@functools.cache
def replica_actor_class(concurrency: int):
    """The replica actor class accepting `concurrency` micro-batches at once (merged by its
    EngineQueue); health probes run beside them. (Ray takes concurrency groups only here.)
    Imported here: the replica brings torch, which `eagle-ray status | shutdown` do without."""
    from eagle_ray.pool.replica import TargetReplica

    return ray.remote(concurrency_groups={"generate": concurrency, "health": 1})(TargetReplica)


def start_replica(config: PoolConfig, index: int) -> ActorHandle:
    """Reserve a placement group and start replica `index` in it; the caller registers it with
    the router (`add_replica`) and keeps the handle: a non-detached actor dies with its owner.

    A group that does not fit stays pending (an autoscaler may add a node for it); the rest of
    the pool keeps serving.
    """
    pg = create_replica_placement_group(config, index)
    handle = replica_actor_class(config.replica_concurrency).options(
        name=config.replica_name(index), namespace=config.namespace,
        lifetime="detached" if config.detached else None,
        max_restarts=-1, max_task_retries=0,
        **replica_actor_options(config, pg),
    ).remote(config, index)
    logger.info("replica %d requested (%s for %d TP rank(s))", index, pg.bundle_specs[0],
                config.tp_size)
    return handle


def kill_replica(config: PoolConfig, index: int) -> None:
    """Kill replica `index` and remove its placement group (either may be gone already); the
    router should have drained it first (`remove_replica`)."""
    try:
        ray.kill(ray.get_actor(config.replica_name(index), namespace=config.namespace),
                 no_restart=True)
    except ValueError:
        pass
    try:
        remove_placement_group(ray.util.get_placement_group(config.placement_group_name(index)))
    except ValueError:
        pass


def live_replica_names(prefix: str, namespace: str) -> list[str]:
    """Names of a pool's replica actors alive on the cluster (`PoolConfig.replica_prefix`)."""
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == namespace and a["name"].startswith(prefix)]


def replica_index(name: str, prefix: str) -> int:
    return int(name[len(prefix):])


def replica_indices(config: PoolConfig) -> list[int]:
    """Indices of the pool's replicas alive on the cluster (found by actor name)."""
    return sorted(replica_index(name, config.replica_prefix)
                  for name in live_replica_names(config.replica_prefix, config.namespace))


def pending_placement_groups(config: PoolConfig) -> int:
    """How many of the pool's placement groups wait for resources the cluster lacks."""
    prefix = config.replica_prefix
    return sum(info["name"].startswith(prefix) and info["state"] == "PENDING"
               for info in ray.util.placement_group_table().values())


def placement_groups(config: PoolConfig) -> list[PlacementGroup]:
    """The pool's placement groups not yet removed."""
    prefix = config.replica_prefix
    return [ray.util.get_placement_group(info["name"])
            for info in ray.util.placement_group_table().values()
            if info["name"].startswith(prefix) and info["state"] != "REMOVED"]
