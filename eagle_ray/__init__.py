"""eagle_ray: a Ray-actor pool of EAGLE-3 target backends that feeds draft training.

The public API is the names in `__all__` (docs/library.md); every other module and name is
private and may change. Importing the package imports neither Ray, torch nor vLLM: each public
name is imported on first use.

Example:
    >>> import eagle_ray as er
    >>> pool = er.TargetPool.create(er.PoolConfig())  # the tiny target; doctest: +SKIP
    >>> client = er.PoolClient.connect(pool.config.name, pool.config.namespace)  # doctest: +SKIP
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from eagle_ray.config import ConfigError
    from eagle_ray.config.pool import AutoscalingConfig, ClientConfig, PoolConfig
    from eagle_ray.contract.checkpoint import load_embedding_and_head
    from eagle_ray.contract.identity import TargetIdentity, checkpoint_fingerprint
    from eagle_ray.contract.supervision import DraftVocab, draft_target, soft_cross_entropy
    from eagle_ray.contract.target_batch import Eagle3TargetBatch
    from eagle_ray.contract.target_head import TargetHead
    from eagle_ray.pool.client import PoolClient
    from eagle_ray.pool.data_stage import (
        SupervisionRows,
        SupervisionStage,
        expect_target,
        map_supervision,
        size_window,
        supervision_bytes_per_token,
        window_config,
        write_supervision_rows,
    )
    from eagle_ray.pool.pool import TargetPool
    from eagle_ray.pool.protocol import (
        MicroBatchFailed,
        MicroBatchOutOfMemory,
        NonFiniteSupervision,
        ReplicaStartupError,
    )
    from eagle_ray.target_runner import SelfCheckError
    from eagle_ray.tiny import tiny_chat_dataset, tiny_target

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # the pool: start or attach, configure, stream
    "TargetPool": "eagle_ray.pool.pool",
    "PoolConfig": "eagle_ray.config.pool",
    "AutoscalingConfig": "eagle_ray.config.pool",
    "PoolClient": "eagle_ray.pool.client",
    "ClientConfig": "eagle_ray.config.pool",
    # sizing the window, the draft's identity check, Ray Data
    "size_window": "eagle_ray.pool.data_stage",
    "window_config": "eagle_ray.pool.data_stage",
    "supervision_bytes_per_token": "eagle_ray.pool.data_stage",
    "expect_target": "eagle_ray.pool.data_stage",
    "SupervisionStage": "eagle_ray.pool.data_stage",
    "map_supervision": "eagle_ray.pool.data_stage",
    "write_supervision_rows": "eagle_ray.pool.data_stage",
    "SupervisionRows": "eagle_ray.pool.data_stage",
    # what a pool serves
    "TargetIdentity": "eagle_ray.contract.identity",
    "checkpoint_fingerprint": "eagle_ray.contract.identity",
    # the supervision record and reading it (docs/contract.md)
    "Eagle3TargetBatch": "eagle_ray.contract.target_batch",
    "TargetHead": "eagle_ray.contract.target_head",
    "load_embedding_and_head": "eagle_ray.contract.checkpoint",
    "DraftVocab": "eagle_ray.contract.supervision",
    "draft_target": "eagle_ray.contract.supervision",
    "soft_cross_entropy": "eagle_ray.contract.supervision",
    # errors
    "ConfigError": "eagle_ray.config",
    "MicroBatchFailed": "eagle_ray.pool.protocol",
    "MicroBatchOutOfMemory": "eagle_ray.pool.protocol",
    "NonFiniteSupervision": "eagle_ray.pool.protocol",
    "ReplicaStartupError": "eagle_ray.pool.protocol",
    "SelfCheckError": "eagle_ray.target_runner",
    # the tiny kit (examples, tests)
    "tiny_target": "eagle_ray.tiny",
    "tiny_chat_dataset": "eagle_ray.tiny",
}

# Exactly the keys of _EXPORTS (tests/pool/test_library.py checks it).
__all__ = ["AutoscalingConfig", "ClientConfig", "ConfigError", "DraftVocab", "Eagle3TargetBatch",
           "MicroBatchFailed", "MicroBatchOutOfMemory", "NonFiniteSupervision", "PoolClient",
           "PoolConfig", "ReplicaStartupError", "SelfCheckError", "SupervisionRows",
           "SupervisionStage", "TargetHead", "TargetIdentity", "TargetPool",
           "checkpoint_fingerprint", "draft_target", "expect_target", "load_embedding_and_head",
           "map_supervision", "size_window", "soft_cross_entropy", "supervision_bytes_per_token",
           "tiny_chat_dataset", "tiny_target", "window_config", "write_supervision_rows"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
