"""The Ray target pool: replica actors in placement groups, a router actor, a client.

Public API: `TargetPool`, `PoolConfig`, `PoolClient`, `ClientConfig`, `MicroBatchFailed`,
`MicroBatchOutOfMemory`, `NonFiniteSupervision`, `ReplicaStartupError`. The
client (and with it torch) is imported on first use: managing a pool (`eagle-ray status`,
`shutdown`) needs neither.
"""

from typing import Any

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.pool.pool import TargetPool
from eagle_ray.pool.protocol import (
    MicroBatchFailed,
    MicroBatchOutOfMemory,
    NonFiniteSupervision,
    ReplicaStartupError,
)

__all__ = ["ClientConfig", "MicroBatchFailed", "MicroBatchOutOfMemory", "NonFiniteSupervision",
           "PoolClient", "PoolConfig", "ReplicaStartupError", "TargetPool"]


def __getattr__(name: str) -> Any:
    if name == "PoolClient":
        from eagle_ray.pool.client import PoolClient

        return PoolClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
