"""Starting and stopping one replica: an actor in its own placement group. Only the pool's
controller calls these (`pool/controller.py`, the one owner of a pool's replicas)."""

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


def start_replica(config: PoolConfig, index: int) -> tuple[ActorHandle, PlacementGroup]:
    """Reserve a placement group and start replica `index` in it. The caller keeps the handle
    (a non-detached actor dies with its owner) and registers it with the router.

    A group that does not fit stays pending (an autoscaler may add a node for it); the rest of
    the pool keeps serving.
    """
    group = create_replica_placement_group(config, index)
    handle = replica_actor_class(config.replica_concurrency).options(
        name=config.replica_name(index), namespace=config.namespace,
        lifetime="detached" if config.detached else None,
        max_restarts=-1, max_task_retries=0,
        **replica_actor_options(config, group),
    ).remote(config, index)
    logger.info("replica %d requested (%s for %d TP rank(s))", index, group.bundle_specs[0],
                config.tp_size)
    return handle, group


def stop_replica(handle: ActorHandle | None, group: PlacementGroup | None) -> None:
    """Kill a replica and remove its placement group (either may be gone already, or None); the
    router should have drained it first (`PoolRouter.remove_replica`)."""
    try:
        if handle is not None:
            ray.kill(handle, no_restart=True)
    except Exception as e:  # gone already
        logger.debug("replica already gone: %s", e)
    if group is not None:
        try:
            remove_placement_group(group)
        except Exception as e:  # removed already (or its node is gone)
            logger.debug("placement group %s: %s", group.id, e)


def group_pending(group: PlacementGroup) -> bool:
    """Whether the group still waits for resources the cluster lacks."""
    return ray.util.placement_group_table(group).get("state") == "PENDING"
