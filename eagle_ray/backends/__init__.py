"""Target backends: the seam every engine implements (`base`), the transformers reference (`hf`),
vLLM (`vllm/`), what differs per engine (`engines`), and `build_backend`, which builds a pool
replica's backend from its config. Importing this package imports neither torch nor an engine:
each backend is imported when it is built, so managing a pool stays light.

The public paths `eagle_ray.target_runner`, `eagle_ray.hf_target` and `eagle_ray.vllm_target`
re-export `base`, `hf` and `vllm.target`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from eagle_ray.backends.engines import ENGINES
from eagle_ray.config.pool import PoolConfig

if TYPE_CHECKING:
    from eagle_ray.backends.base import RunnerEagle3TargetModel



def resolve_model_path(config: PoolConfig) -> str | None:
    """The checkpoint a replica serves: the configured one, the built-in tiny target
    (`builtin_target`, pre-trained on the kit's generated chats) when none is configured,
    nothing for a factory backend."""
    if config.model_path is not None or config.backend not in ENGINES:
        return config.model_path
    if config.builtin_target == "llama":
        from eagle_ray.tiny import tiny_target

        return str(tiny_target("llama", pretrained=True))
    from eagle_ray.tiny.vision import tiny_vl_target

    return str(tiny_vl_target(config.builtin_target, pretrained=True))


def build_backend(config: PoolConfig, object_store_bytes: int = 0) -> RunnerEagle3TargetModel:
    """The backend a replica owns, from the pool config (`object_store_bytes`: the Ray object
    store's size on the replica's node, which shares /dev/shm with vLLM's hand-off ring)."""
    engine = ENGINES.get(config.backend)
    if engine is not None:
        dtype = None if config.dtype == "auto" else config.dtype
        return engine.build(config, resolve_model_path(config), dtype, object_store_bytes)
    module_name, _, attr = config.backend.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)
