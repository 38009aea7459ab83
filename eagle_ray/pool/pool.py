"""`TargetPool`: builds, scales and tears down a router and its replicas on a Ray cluster."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.pool.controller import ROUTER_RESTART_WAIT_S, PoolController
from eagle_ray.pool.placement import replica_bundle
from eagle_ray.pool.protocol import PoolStatus, ReplicaStartupError
from eagle_ray.pool.router import PoolRouter
from eagle_ray.pool.states import ReplicaState
from eagle_ray.ray_compat import HEAD_NODE_RESOURCE

if TYPE_CHECKING:
    from eagle_ray.pool.client import PoolClient

logger = logging.getLogger(__name__)



_RouterActor = ray.remote(PoolRouter)
_ControllerActor = ray.remote(PoolController)


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

    def __init__(self, config: PoolConfig, router: Any, controller: Any) -> None:
        self.config = config
        self.router = router  # owned by the pool's creator unless detached: the pool's life
        self.controller = controller  # the replicas' one owner (`pool/controller.py`)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    def create(cls, config: PoolConfig, wait: bool = True) -> TargetPool:
        """Start the router and the controller, which starts `config.replicas` replicas (with
        `autoscaling`: that many within its bounds, and sizes the pool from then on).

        Connects to Ray first when this process has not (`ray.init` in the pool's namespace).

        Args:
            config: the pool to build (docs/configuration.md); its `name` and `namespace`
                name every actor and placement group.
            wait: block until all replicas are ready (up to `config.ready_timeout_s`, then
                `TimeoutError` saying what is missing; `ReplicaStartupError` at once, with the
                pool shut down, when replicas cannot build their backend).
        """
        if not ray.is_initialized():
            ray.init(namespace=config.namespace)
        _refuse_a_running_pool(config)
        router = _RouterActor.options(
            name=config.router_name, namespace=config.namespace,
            lifetime="detached" if config.detached else None,
            max_restarts=-1, num_cpus=0, max_concurrency=10_000,
            resources=dict(config.router_resources),
        ).remote(config)
        # The replicas' owner lives on the head node: a node an autoscaler reclaims (or the
        # router's, when it fails) takes no replica down with it. Detached in every pool: it
        # follows the router, which ends with this process unless the pool is detached, and
        # removes the replicas then (`pool/controller.py`). It looks the router up by name: a
        # handle among its arguments would be an object-store argument to Ray (an error line).
        controller = _ControllerActor.options(
            name=config.controller_name, namespace=config.namespace,
            lifetime="detached", max_restarts=-1, num_cpus=0,
            resources={HEAD_NODE_RESOURCE: 0.001},
        ).remote(config)
        pool = cls(config, router, controller)
        pool._call_controller("members")  # returns once it has started the first replicas
        replicas = config.initial_replicas
        if wait and replicas:
            try:
                pool.wait_ready(replicas, config.ready_timeout_s)
            except (ReplicaStartupError, TimeoutError):
                pool.shutdown()  # nothing of a pool that cannot serve stays on the cluster
                raise
        return pool

    @classmethod
    def connect(cls, name: str = "eagle_ray_pool", namespace: str = "eagle_ray") -> TargetPool:
        """Attach to a running (e.g. detached) pool by name, with the configuration it was
        created with (the router keeps it): `add_replica` starts replicas like its others."""
        try:
            router = ray.get_actor(PoolConfig(name=name, namespace=namespace).router_name,
                                   namespace=namespace)
        except ValueError:
            raise ValueError(f"no eagle_ray pool named {name!r} in namespace {namespace!r} on "
                             f"this cluster; start one with `eagle-ray serve`") from None
        config = _call(router, "pool_config")
        return cls(config, router, ray.get_actor(config.controller_name, namespace=namespace))

    def add_replica(self) -> int:
        """Reserve a placement group and start one replica in it; returns its index.

        A replica whose group does not fit the cluster stays pending (an autoscaler may add a
        node for it); the rest of the pool keeps serving. On an autoscaled pool the controller
        may later remove it again, as demand says.
        """
        return self._call_controller("add_replica")

    def remove_replica(self, index: int | None = None, drain: bool = True) -> int:
        """Stop routing to a replica (the newest by default), drain it, then kill it."""
        return self._call_controller("remove_replica", index, drain)

    def wait_ready(self, min_replicas: int, timeout_s: float = 600.0) -> dict[str, Any]:
        """Block until at least `min_replicas` replicas are ready; returns the status. Replicas
        that cannot build their backend end the wait at once (`ReplicaStartupError`, with the
        engine's message) when too few are left to reach `min_replicas`."""
        started = time.monotonic()
        while True:
            status = self.pool_status()
            if status.ready_replicas >= min_replicas:
                return status.to_dict()
            failed = {name: r.error for name, r in status.replicas.items()
                      if r.state is ReplicaState.FAILED}
            if failed and len(status.replicas) - len(failed) < min_replicas:
                raise ReplicaStartupError.of(self.config.name, failed, len(status.replicas))
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(self._not_ready(status, min_replicas, timeout_s))
            time.sleep(0.5)

    def _not_ready(self, status: PoolStatus, min_replicas: int, waited_s: float) -> str:
        """Why replicas are not ready: no resources yet, or still starting, or not answering."""
        states = [r.state for r in status.replicas.values()]
        pending = self._call_controller("pending_groups")
        reasons = []
        if pending:
            reasons.append(f"no resources yet: {pending} placement group(s) pending, each "
                           f"{replica_bundle(self.config)} on one node (add nodes, or let the "
                           f"autoscaler)")
        starting = states.count(ReplicaState.STARTING) - pending
        if starting > 0:
            reasons.append(f"{starting} replica(s) placed and still starting after "
                           f"{waited_s:.0f}s (loading the engine; raise ready_timeout_s for a "
                           f"large checkpoint)")
        if ReplicaState.SUSPECT in states:
            reasons.append(f"{states.count(ReplicaState.SUSPECT)} replica(s) not answering")
        return (f"only {status.ready_replicas} of {min_replicas} replicas ready after "
                f"{waited_s:.0f}s: " + "; ".join(reasons or ["no replica was started"]))

    def pool_status(self) -> PoolStatus:
        """The router's view, typed (states as `ReplicaState`): per replica state, outstanding
        tokens, tokens/s, errors, restarts; demand, leases, autoscaling."""
        return self._call_router("status")

    def status(self) -> dict[str, Any]:
        """`pool_status()` as JSON-ready data (states as their values: the CLI's view)."""
        return self.pool_status().to_dict()

    def identity(self, timeout_s: float = 600.0) -> TargetIdentity:
        """What the pool serves (checkpoint, fingerprint, layers, vocabulary, aux ids), as a
        ready replica reports it; waits up to `timeout_s` for one."""
        return self._call_router("target_info", timeout_s).identity

    def client(self, config: ClientConfig | None = None) -> PoolClient:
        """A client for this process (training workers use `PoolClient.connect` instead)."""
        from eagle_ray.pool.client import PoolClient  # torch: not needed to manage a pool

        return PoolClient.connect(self.config.name, self.config.namespace, config)

    def shutdown(self) -> None:
        """Kill the replicas (their owner removes their placement groups), the controller and
        the router."""
        self._call_controller("shutdown")
        ray.kill(self.controller, no_restart=True)
        ray.kill(self.router, no_restart=True)
        logger.info("pool %s shut down", self.config.name)

    # ------------------------------------------------------------------ helpers

    def _call_router(self, method: str, *args: Any) -> Any:
        return _call(self.router, method, *args)

    def _call_controller(self, method: str, *args: Any) -> Any:
        return _call(self.controller, method, *args)


def _call(actor: Any, method: str, *args: Any) -> Any:
    """Call the pool's router or controller, waiting out a restart (up to
    ROUTER_RESTART_WAIT_S): every method the pool calls is idempotent, so a call that may have
    run is safe to repeat."""
    deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
    while True:
        try:
            return ray.get(getattr(actor, method).remote(*args))
        except RayActorError:
            if time.monotonic() > deadline:
                raise
            logger.info("%s is restarting; calling %s again", actor, method)
            time.sleep(0.5)


def _refuse_a_running_pool(config: PoolConfig) -> None:
    """A second pool of the same name would fail on Ray's taken-name error half way through
    creating it; say which pool runs and what to do instead, before anything starts. A pool of
    that name whose creator just ended is waited for: its controller is removing its replicas,
    whose names it then frees."""
    try:
        ray.get_actor(config.router_name, namespace=config.namespace)
    except ValueError:
        _wait_until_gone(config.controller_name, config.namespace)
        return
    raise ValueError(
        f"a pool named {config.name!r} already runs in namespace {config.namespace!r} on this "
        f"cluster: use it (`use_shared_pool: true` in a job, `TargetPool.connect`), remove it "
        f"(`eagle-ray shutdown --name {config.name} --namespace {config.namespace}`), or name "
        f"this one differently (`target.name`)")


def _wait_until_gone(name: str, namespace: str) -> None:
    """Wait (up to ROUTER_RESTART_WAIT_S) until no actor is named `name`."""
    deadline = time.monotonic() + ROUTER_RESTART_WAIT_S
    while True:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{name}, of an ended pool of the same name, is still there "
                               f"after {ROUTER_RESTART_WAIT_S:.0f}s removing its replicas (its "
                               f"log says why)")
        logger.info("%s is removing an ended pool of the same name; waiting", name)
        time.sleep(0.5)
