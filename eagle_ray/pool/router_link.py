"""A client's calls to the router, batched: every micro-batch waiting for a replica is asked for
in one `acquire_many` per client round and every finished lease is reported in one
`release_many`, so the router's work per micro-batch is a fraction of a call however many clients
and micro-batches there are. Also finds the router by name (again, after it restarts)."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.pool.inflight import InFlightMicroBatch

logger = logging.getLogger(__name__)

ROUTER_RETRY_S = 0.5  # pause before asking a restarting router again


class RouterUnavailable(RuntimeError):
    """The router stayed unreachable for the whole lease timeout."""


class RouterLink:
    """See the module docstring. `connect` builds one; the client owns it."""

    def __init__(self, router: ActorHandle, router_name: str | None, namespace: str | None,
                 node_id: str) -> None:
        self.router, self.router_name, self.namespace = router, router_name, namespace
        self.node_id = node_id  # sent with every request, for locality-aware leases
        self._releases: list[tuple[str, int, bool, bool]] = []

    @classmethod
    def connect(cls, pool_name: str, namespace: str, config: ClientConfig
                ) -> tuple[RouterLink, dict[str, Any], int]:
        """`(link, what a replica reported, times the router was unavailable)`, waiting for a
        restarting router up to `config.lease_timeout_s`."""
        router_name = PoolConfig(name=pool_name, namespace=namespace).router_name
        deadline = time.monotonic() + config.lease_timeout_s
        unavailable = 0
        while True:
            try:
                router = ray.get_actor(router_name, namespace=namespace)
            except ValueError:
                raise ValueError(f"no eagle_ray pool named {pool_name!r} in namespace "
                                 f"{namespace!r}; start one with `eagle-ray serve` or "
                                 f"TargetPool.create") from None
            try:
                info = ray.get(router.target_info.remote(config.lease_timeout_s),
                               timeout=max(deadline - time.monotonic(), 1.0))
                break
            except RayActorError as e:  # the router is restarting: wait for it
                unavailable += 1
                if time.monotonic() > deadline:
                    raise RouterUnavailable(f"the router of pool {pool_name!r} stayed "
                                            f"unavailable for {config.lease_timeout_s:.0f}s: "
                                            f"{e}") from e
                logger.warning("router of pool %r unavailable (%s); retrying", pool_name,
                               type(e).__name__)
                time.sleep(ROUTER_RETRY_S)
        link = cls(router, router_name, namespace, ray.get_runtime_context().get_node_id())
        return link, info, unavailable

    def ask(self, items: Sequence[InFlightMicroBatch], timeout_s: float) -> None:
        """One `acquire_many` for `items`; each keeps the shared answer's ref (`lease_ref`)."""
        if items:
            ref = self.router.acquire_many.remote(
                [(i.micro_batch_id, i.num_tokens, i.failed_on) for i in items], timeout_s,
                self.node_id)
            for item in items:
                item.lease_ref = ref

    def release(self, replica: str, num_tokens: int, ok: bool, replica_died: bool) -> None:
        """Queue a finished lease's report (sent by `flush`)."""
        self._releases.append((replica, num_tokens, ok, replica_died))

    def flush(self) -> None:
        """Report every queued lease in one call."""
        if self._releases:
            reports, self._releases = self._releases, []
            try:
                self.router.release_many.remote(reports)
            except RayActorError:
                pass  # a restarted router starts counting afresh

    def reconnect(self) -> None:
        """Look the router up again by name (after it restarted or was replaced)."""
        if self.router_name is None:
            return
        try:
            self.router = ray.get_actor(self.router_name, namespace=self.namespace)
        except ValueError:
            pass  # not back yet
