"""`TargetPool`: builds, scales and tears down a router and its replicas on a Ray cluster."""

from __future__ import annotations

import logging
import time
from typing import Any

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import PlacementGroup, remove_placement_group

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.identity import TargetIdentity
from eagle_ray.pool.client import PoolClient
from eagle_ray.pool.placement import (
    create_replica_placement_group,
    replica_actor_options,
    replica_bundles,
)
from eagle_ray.pool.replica import TargetReplica
from eagle_ray.pool.router import PoolRouter

logger = logging.getLogger(__name__)

ROUTER_RESTART_WAIT_S = 120.0

# One engine call at a time; health probes run beside it.
_ReplicaActor = ray.remote(concurrency_groups={"generate": 1, "health": 1})(TargetReplica)
_RouterActor = ray.remote(PoolRouter)


class TargetPool:
    """A pool of EAGLE-3 target replicas behind one router.

    Example:
        >>> import ray
        >>> ray.init()                                                  # doctest: +SKIP
        >>> pool = TargetPool.create(PoolConfig(model_path="/models/llama-8b", replicas=2,
        ...                                     tp_size=2, use_gpu=True))  # doctest: +SKIP
        >>> client = pool.client()                                      # doctest: +SKIP
        >>> batch = client.result(client.submit(ids, attention_mask, loss_mask))  # doctest: +SKIP
        >>> pool.shutdown()                                             # doctest: +SKIP
    """

    def __init__(self, config: PoolConfig, router: Any) -> None:
        self.config = config
        self.router = router
        self._next_index = 0
        # Non-detached actors die with their last handle: the pool keeps one per replica.
        self._handles: dict[int, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, config: PoolConfig, wait: bool = True) -> TargetPool:
        """Start the router and `config.replicas` replicas.

        Connects to Ray first when this process has not (`ray.init` in the pool's namespace).

        Args:
            config: the pool to build (README, "Pool config keys"); its `name` and `namespace`
                name every actor and placement group.
            wait: block until all replicas are ready (up to `config.ready_timeout_s`, then
                `TimeoutError` naming the resources that are missing).
        """
        if not ray.is_initialized():
            ray.init(namespace=config.namespace)
        router = _RouterActor.options(
            name=config.router_name, namespace=config.namespace,
            lifetime="detached" if config.detached else None,
            max_restarts=-1, num_cpus=0, max_concurrency=10_000,
            resources=dict(config.router_resources),
        ).remote(config.replica_prefix, config.namespace,
                 config.max_outstanding_tokens_per_replica, config.locality)
        pool = cls(config, router)
        for _ in range(config.replicas):
            pool.add_replica()
        if wait and config.replicas:
            pool.wait_ready(config.replicas, config.ready_timeout_s)
        return pool

    @classmethod
    def connect(cls, name: str = "eagle_ray_pool", namespace: str = "eagle_ray") -> TargetPool:
        """Attach to a running (e.g. detached) pool by name."""
        config = PoolConfig(name=name, namespace=namespace)
        try:
            router = ray.get_actor(config.router_name, namespace=namespace)
        except ValueError:
            raise ValueError(f"no eagle_ray pool named {name!r} in namespace {namespace!r} on "
                             f"this cluster; start one with `eagle-ray serve`") from None
        pool = cls(config, router)
        pool._next_index = 1 + max(pool._replica_indices(), default=-1)
        return pool

    def add_replica(self) -> int:
        """Reserve a placement group and start one replica in it; returns its index.

        A replica whose group does not fit the cluster stays pending (an autoscaler may add a
        node for it); the rest of the pool keeps serving.
        """
        index = self._next_index
        self._next_index += 1
        pg = create_replica_placement_group(self.config, index)
        handle = _ReplicaActor.options(
            name=self.config.replica_name(index), namespace=self.config.namespace,
            lifetime="detached" if self.config.detached else None,
            max_restarts=-1, max_task_retries=0,
            **replica_actor_options(self.config, pg),
        ).remote(self.config, index)
        self._handles[index] = handle
        self._call_router("add_replica", self.config.replica_name(index), handle)
        logger.info("replica %d requested (%d bundle(s) %s, %s)", index, self.config.tp_size,
                    pg.bundle_specs[0], self.config.placement_strategy)
        return index

    def remove_replica(self, index: int | None = None, drain: bool = True) -> int:
        """Stop routing to a replica (the newest by default), drain it, then kill it."""
        indices = self._replica_indices()
        if not indices:
            raise ValueError("the pool has no replicas to remove")
        index = max(indices) if index is None else index
        drained = self._call_router("remove_replica", self.config.replica_name(index), drain)
        if not drained:
            logger.warning("replica %d did not drain in time; its micro-batches will be re-run",
                           index)
        self._kill(index)
        return index

    def wait_ready(self, min_replicas: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until at least `min_replicas` replicas are ready; returns the status."""
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status()
            if status["ready_replicas"] >= min_replicas:
                return status
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {status['ready_replicas']} of {min_replicas} replicas ready after "
                    f"{timeout_s:.0f}s: {status['replicas']}; pending placement groups mean the "
                    f"cluster lacks resources for {self.config.tp_size} bundle(s) of "
                    f"{replica_bundles(self.config)[0]}")
            time.sleep(0.5)

    def status(self) -> dict[str, Any]:
        """The router's view: per replica state, outstanding tokens, tokens/s, errors, restarts."""
        return self._call_router("status")

    def identity(self, timeout_s: float = 600.0) -> TargetIdentity:
        """What the pool serves (checkpoint, fingerprint, layers, vocabulary, aux ids), as a
        ready replica reports it; waits up to `timeout_s` for one."""
        info = self._call_router("target_info", timeout_s)
        return TargetIdentity.from_dict(info["identity"])

    def client(self, config: ClientConfig | None = None) -> PoolClient:
        """A client for this process (training workers use `PoolClient.connect` instead)."""
        return PoolClient.connect(self.config.name, self.config.namespace, config)

    def shutdown(self) -> None:
        """Kill the replicas and the router and remove the placement groups."""
        for index in self._replica_indices():
            self._kill(index)
        for pg in self._placement_groups():
            remove_placement_group(pg)
        self._handles.clear()
        ray.kill(self.router, no_restart=True)
        logger.info("pool %s shut down", self.config.name)

    # ------------------------------------------------------------------ helpers

    def _call_router(self, method: str, *args: Any) -> Any:
        """Call the router, waiting out a restart (up to ROUTER_RESTART_WAIT_S): every router
        method the pool calls is idempotent, so a call that may have run is safe to repeat."""
        deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
        while True:
            try:
                return ray.get(getattr(self.router, method).remote(*args))
            except RayActorError:
                if time.monotonic() > deadline:
                    raise
                logger.info("router of pool %s is restarting; calling %s again",
                            self.config.name, method)
                time.sleep(0.5)

    def _replica_indices(self) -> list[int]:
        prefix = self.config.replica_prefix
        return sorted(int(a["name"][len(prefix):])
                      for a in ray.util.list_named_actors(all_namespaces=True)
                      if a["namespace"] == self.config.namespace and a["name"].startswith(prefix))

    def _placement_groups(self) -> list[PlacementGroup]:
        prefix = self.config.replica_prefix
        return [ray.util.get_placement_group(info["name"])
                for info in ray.util.placement_group_table().values()
                if info["name"].startswith(prefix) and info["state"] != "REMOVED"]

    def _kill(self, index: int) -> None:
        """Kill replica `index` and remove its placement group (either may be gone already)."""
        self._handles.pop(index, None)
        try:
            ray.kill(ray.get_actor(self.config.replica_name(index),
                                   namespace=self.config.namespace), no_restart=True)
        except ValueError:
            pass
        try:
            remove_placement_group(
                ray.util.get_placement_group(self.config.placement_group_name(index)))
        except ValueError:
            pass

