"""GPU-aware placement: one placement group per replica, holding one bundle with every GPU of its
tensor-parallel ranks.

The replica actor holds the whole bundle (`tp_size` GPUs on one node) and vLLM runs its TP ranks
as the actor's own worker processes (its multiprocess executor): the topology the CPU tests run,
and one whose workers live and die with the replica. Scaling is creating or removing one group.
"""

from __future__ import annotations

from typing import Any

from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eagle_ray.config.pool import PoolConfig


def replica_bundle(config: PoolConfig) -> dict[str, float]:
    """A replica's resources: per TP rank a GPU (on GPU clusters), `cpus_per_bundle` CPUs and the
    custom `bundle_resources`, all on one node."""
    per_rank: dict[str, float] = {"CPU": config.cpus_per_bundle, **config.bundle_resources}
    if config.use_gpu:
        per_rank["GPU"] = 1.0
    return {name: amount * config.tp_size for name, amount in per_rank.items()}


def create_replica_placement_group(config: PoolConfig, index: int) -> PlacementGroup:
    """Reserve one replica's resources; a group that does not fit stays pending, never fails.
    Detached in every pool, as the replica is: Ray removes a group its creator (the controller,
    a detached actor) made otherwise when that creator dies, restarts included, and kills the
    replica in it. The controller removes it, after the replica, when the pool ends."""
    return placement_group(
        [replica_bundle(config)],
        strategy="STRICT_PACK",
        name=config.placement_group_name(index),
        lifetime="detached",
    )


def replica_actor_options(config: PoolConfig, pg: PlacementGroup) -> dict[str, Any]:
    """Ray actor options that give a replica its group's whole bundle (Ray then sets its
    `CUDA_VISIBLE_DEVICES` to those GPUs, which vLLM's worker processes inherit)."""
    bundle = replica_bundle(config)
    return {
        "num_cpus": bundle.pop("CPU"),
        "num_gpus": bundle.pop("GPU", 0),
        "resources": bundle,
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        ),
        "runtime_env": config.runtime_env or None,
    }
