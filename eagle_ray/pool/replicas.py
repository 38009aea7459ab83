"""Starting and stopping one replica: an actor in its own placement group. Only the pool's
controller calls these (`pool/controller.py`, the one owner of a pool's replicas)."""

from __future__ import annotations

import functools
import importlib
import logging

import ray
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup, remove_placement_group

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.placement import create_replica_placement_group, replica_actor_options

logger = logging.getLogger(__name__)

# Ray warns at every restartable detached actor placed in a group that removing the group kills
# it for good (`ray/actor.py`). Not so here: a replica's group is removed only by `stop_replica`,
# after the replica is killed. The warning would greet every pool start, so it is dropped.
RAY_GROUP_WARNING = "Scheduling a restartable detached actor with a placement group"


class _NoGroupWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(RAY_GROUP_WARNING)


_NO_GROUP_WARNING = _NoGroupWarning()


@functools.cache
def replica_actor_class(concurrency: int, class_path: str):
    """The replica actor class (`PoolConfig.replica_class`) accepting `concurrency` micro-batches
    at once (merged by its EngineQueue); health probes run beside them. (Ray takes concurrency
    groups only here.) Imported here: the replica brings torch, which `eagle-ray status |
    shutdown` do without."""
    module, name = class_path.split(":")
    actor = getattr(importlib.import_module(module), name)
    return ray.remote(concurrency_groups={"generate": concurrency, "health": 1})(actor)


def start_replica(config: PoolConfig, index: int) -> tuple[ActorHandle, PlacementGroup]:
    """Reserve a placement group and start replica `index` in it, as a detached actor in every
    pool: an owned one would die with the controller, and its engine with it; the controller
    removes it when the pool ends (`PoolController._follow_the_router`). The caller registers it
    with the router.

    A group that does not fit stays pending (an autoscaler may add a node for it); the rest of
    the pool keeps serving.
    """
    group = create_replica_placement_group(config, index)
    logging.getLogger("ray.actor").addFilter(_NO_GROUP_WARNING)  # again: no second copy
    handle = replica_actor_class(config.replica_concurrency, config.replica_class).options(
        name=config.replica_name(index), namespace=config.namespace,
        lifetime="detached",
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
