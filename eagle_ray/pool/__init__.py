"""The Ray target pool: replica actors in placement groups, a router actor, a client.

Public API: `TargetPool`, `PoolConfig`, `PoolClient`, `ClientConfig`, `MicroBatchFailed`.
"""

from eagle_ray.config.pool import ClientConfig, PoolConfig
from eagle_ray.pool.client import MicroBatchFailed, PoolClient
from eagle_ray.pool.pool import TargetPool

__all__ = ["ClientConfig", "MicroBatchFailed", "PoolClient", "PoolConfig", "TargetPool"]
