"""What differs per built-in backend, in one place: how a replica builds it, what its config may
not say (checked as the config loads), how a job sizes its engines, and the longest sequence an
engine takes (what `eagle-ray plan` checks its KV cache against).

The rest of the package asks `ENGINES[config.backend]` and never tests a backend's name. A
factory backend (`package.module:factory`) has no entry: it builds itself and is sized by no one.
Nothing here imports an engine, torch or eagle_ray's config (the config imports this module to
check itself): each backend's module is imported when a replica builds it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

# A pool config (`eagle_ray.config.PoolConfig`); typed loosely: the config imports this module.
PoolConfigLike = Any


@dataclasses.dataclass(frozen=True)
class Engine:
    """One built-in backend's particulars."""

    name: str
    build: Callable[[PoolConfigLike, str | None, str | None, int], Any]
    """(pool config, checkpoint path, dtype or None, object store bytes) -> the replica's
    backend (an `eagle_ray.backends.base.RunnerEagle3TargetModel`)."""
    check_config: Callable[[PoolConfigLike], None]
    """Raise ValueError, naming the key and what to do, for settings this engine cannot take."""
    sized_for: Callable[[PoolConfigLike, int], PoolConfigLike]
    """The pool config with engines sized for sequences of at most this many tokens (the
    config itself where the engine needs no size or the user set one)."""
    max_model_len: Callable[[PoolConfigLike], int | None]
    """The longest sequence the engine is configured for; None: no fixed limit (no KV cache)."""
    in_own_process: Callable[[PoolConfigLike], PoolConfigLike] = lambda config: config
    """The pool config with the engine's GPU work in processes of its own, so its memory goes
    back to the device when it shuts down (an engine the evaluation starts before others)."""


def _build_vllm(config: PoolConfigLike, model_path: str | None, dtype: str | None,
                object_store_bytes: int) -> Any:
    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

    return VLLMEagle3TargetModel.from_pretrained(
        model_path, aux_layer_ids=config.aux_layer_ids, dtype=dtype, tp_size=config.tp_size,
        vllm_kwargs=config.vllm_kwargs, encoding=config.encoding,
        max_call_tokens=config.max_tokens_per_engine_call,
        object_store_bytes=object_store_bytes, **config.backend_kwargs)


def _check_vllm(config: PoolConfigLike) -> None:
    from eagle_ray.backends.vllm.engine_args import check_vllm_kwargs

    check_vllm_kwargs(config.vllm_kwargs, config.tp_size)


def _size_vllm(config: PoolConfigLike, longest: int) -> PoolConfigLike:
    """`max_model_len` for the longest sequence plus the one token vLLM samples, unless set."""
    if "max_model_len" in config.vllm_kwargs:
        return config
    return dataclasses.replace(config, vllm_kwargs={**config.vllm_kwargs,
                                                    "max_model_len": longest + 1})


def _vllm_in_own_process(config: PoolConfigLike) -> PoolConfigLike:
    """The engine core and its worker in their own process (vLLM's multiprocess engine)."""
    return dataclasses.replace(config, backend_kwargs={**config.backend_kwargs,
                                                      "multiprocess": True})


def _build_hf(config: PoolConfigLike, model_path: str | None, dtype: str | None,
              object_store_bytes: int) -> Any:
    from eagle_ray.backends.hf import HFEagle3TargetModel

    return HFEagle3TargetModel.from_pretrained(
        model_path, aux_layer_ids=config.aux_layer_ids, dtype=dtype,
        device="cuda" if config.use_gpu else None, encoding=config.encoding,
        **config.backend_kwargs)


def _check_hf(config: PoolConfigLike) -> None:
    if config.tp_size != 1:
        raise ValueError(f"tp_size={config.tp_size}: the hf backend runs a target on one "
                         f"device; set tp_size: 1, or backend: vllm for tensor parallelism")


ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", _build_vllm, _check_vllm, _size_vllm,
                   lambda config: config.vllm_kwargs.get("max_model_len"),
                   _vllm_in_own_process),
    "hf": Engine("hf", _build_hf, _check_hf, lambda config, longest: config,
                 lambda config: None),
}
