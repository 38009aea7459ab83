"""Ray's private APIs that eagle_ray uses, in one place, each with why no public API serves.

Written against Ray 2.60. A Ray upgrade that moves any of them breaks here and nowhere else:
check this module first (tests/test_imports.py keeps the rest of the package off them).
"""

from __future__ import annotations

from typing import Any


def actor_id(handle: Any) -> str:
    """The id of the actor behind `handle`, from outside it. Public: only
    `ray.get_runtime_context().get_actor_id()`, inside the actor; the pool's grants carry the
    id so a client looks a replica up by name once and keeps its handle while the id holds."""
    return handle._actor_id.hex()


def kv_get(key: bytes) -> bytes | None:
    """The GCS key-value store: the one place a value outlives the process that wrote it (a
    replica counts its own constructions there, so the restarted actor knows how many died
    unfinished) without an actor of its own. Ray exposes it only as `ray.experimental.
    internal_kv`."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_get(key)


def kv_put(key: bytes, value: bytes) -> None:
    """See `kv_get`."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(key, value)


def kv_delete(key: bytes) -> None:
    """See `kv_get`."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(key)


def autoscaler_node_groups() -> list[tuple[dict[str, float], int]]:
    """The autoscaler's node types as (resources, max count; -1: unbounded): what a job could
    still get that the running nodes do not show. No public API reads the cluster config."""
    from ray._private.state import state

    config = state.get_cluster_config()
    return [({k: float(v) for k, v in group.resources.items()}, group.max_count)
            for group in getattr(config, "node_group_configs", []) or []]


def token_auth_enabled() -> bool:
    """Whether this process's cluster authenticates with tokens (`RAY_AUTH_MODE=token`): asked
    of a process on the cluster, as its own setting, which no public API reports."""
    from ray._private.authentication.authentication_utils import is_token_auth_enabled

    return is_token_auth_enabled()


# Ray's own resource on the head node (every `ray start --head` and KubeRay head advertises it;
# Ray Serve pins its controller with it): where the pool's controller lives, off the worker
# nodes an autoscaler reclaims.
HEAD_NODE_RESOURCE = "node:__internal_head__"
