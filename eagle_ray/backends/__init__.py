"""Target backends: the seam every engine implements (`base`), the transformers reference (`hf`),
vLLM (`vllm/`), and the registry that builds one from a pool config (`build_backend`), used by a
pool replica. Importing this package imports neither torch nor an engine: each backend is
imported when it is built, so managing a pool stays light.

The public paths `eagle_ray.target_runner`, `eagle_ray.hf_target` and `eagle_ray.vllm_target`
re-export `base`, `hf` and `vllm.target`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from eagle_ray.config.pool import PoolConfig

if TYPE_CHECKING:
    from eagle_ray.backends.base import RunnerEagle3TargetModel

BUILT_IN = ("vllm", "hf")  # anything else is a `package.module:factory`


def resolve_model_path(config: PoolConfig) -> str | None:
    """The checkpoint a replica serves: the configured one, the built-in tiny Llama (pre-trained
    on the kit's chat corpus) when none is configured, nothing for a factory backend."""
    if config.model_path is not None or config.backend not in BUILT_IN:
        return config.model_path
    from eagle_ray.tiny import tiny_target

    return str(tiny_target("llama", pretrained=True))


def build_backend(config: PoolConfig, object_store_bytes: int = 0) -> RunnerEagle3TargetModel:
    """The backend a replica owns, from the pool config (`object_store_bytes`: the Ray object
    store's size on the replica's node, which shares /dev/shm with vLLM's hand-off ring)."""
    model_path = resolve_model_path(config)
    dtype = None if config.dtype == "auto" else config.dtype
    if config.backend == "vllm":
        from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

        return VLLMEagle3TargetModel.from_pretrained(
            model_path, aux_layer_ids=config.aux_layer_ids, dtype=dtype, tp_size=config.tp_size,
            vllm_kwargs=config.vllm_kwargs, encoding=config.encoding,
            max_call_tokens=config.max_tokens_per_engine_call,
            object_store_bytes=object_store_bytes, **config.backend_kwargs)
    if config.backend == "hf":
        from eagle_ray.backends.hf import HFEagle3TargetModel

        return HFEagle3TargetModel.from_pretrained(
            model_path, aux_layer_ids=config.aux_layer_ids, dtype=dtype,
            device="cuda" if config.use_gpu else None,
            encoding=config.encoding, **config.backend_kwargs)
    module_name, _, attr = config.backend.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    return factory(config)
