"""GPU-aware placement: one placement group per replica, one bundle per tensor-parallel rank.

`STRICT_PACK` keeps a replica's TP ranks on one node. The replica actor sits in bundle 0; with
TP > 1 on GPUs, vLLM's Ray executor places its workers on the group's bundles (told which through
`VLLM_RAY_BUNDLE_INDICES`), so the actor itself holds no GPU.
"""

from __future__ import annotations

from typing import Any

from ray.util.placement_group import PlacementGroup, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from eagle_ray.backends import engine_workers_hold_gpus
from eagle_ray.config.pool import PoolConfig


def replica_bundles(config: PoolConfig) -> list[dict[str, float]]:
    """One bundle per TP rank: a GPU (on GPU clusters) plus CPUs and any custom resources."""
    bundle: dict[str, float] = {"CPU": config.cpus_per_bundle, **config.bundle_resources}
    if config.use_gpu:
        bundle["GPU"] = 1.0
    return [dict(bundle) for _ in range(config.tp_size)]


def create_replica_placement_group(config: PoolConfig, index: int) -> PlacementGroup:
    """Reserve one replica's resources; a group that does not fit stays pending, never fails."""
    return placement_group(
        replica_bundles(config),
        strategy=config.placement_strategy,
        name=config.placement_group_name(index),
        lifetime="detached" if config.detached else None,
    )


def replica_actor_options(config: PoolConfig, pg: PlacementGroup) -> dict[str, Any]:
    """Ray actor options that pin a replica to bundle 0 of its own group."""
    engine_holds_gpus = engine_workers_hold_gpus(config)
    env_vars = dict(config.runtime_env.get("env_vars", {}))
    if engine_holds_gpus:
        env_vars.setdefault("VLLM_RAY_BUNDLE_INDICES", ",".join(map(str, range(config.tp_size))))
    runtime_env = {**config.runtime_env, "env_vars": env_vars} if env_vars else config.runtime_env
    return {
        "num_cpus": config.cpus_per_bundle,
        "num_gpus": 1 if config.use_gpu and not engine_holds_gpus else 0,
        "resources": dict(config.bundle_resources),
        "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=pg,
            placement_group_bundle_index=0,
            placement_group_capture_child_tasks=True,
        ),
        "runtime_env": runtime_env or None,
    }
