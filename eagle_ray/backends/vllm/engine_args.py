"""Which `vllm.LLM` arguments a capturing engine can take, checked before anything starts: when a
pool config is built (so a job's YAML fails as it loads) and again when an engine is built.
Imports nothing of eagle_ray, nor vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Set by the runner itself; passing them in vllm_kwargs would silently break the capture.
OWNED_KWARGS = ("model", "speculative_config", "kv_transfer_config", "skip_tokenizer_init")
# The executor of TP > 1: the replica holds its GPUs and vLLM's ranks are its worker processes.
TP_EXECUTOR = "mp"
# Compilation passes that rewrite the graph nodes the aux states are read from, and that no run
# has shown to keep the capture equal to HF's: a capture engine turns them off unless the user
# sets them. vLLM 0.32 turns the fused all-reduce + RMSNorm pass on by itself where TP > 1 on
# Hopper / Blackwell with flashinfer (`vllm/config/vllm.py`, `enable_allreduce_rms_fusion`);
# CPU engines never run it, so nothing here has seen the capture under it.
UNVERIFIED_PASSES: dict[str, bool] = {"fuse_allreduce_rms": False}


def check_vllm_kwargs(vllm_kwargs: Mapping[str, Any], tp_size: int) -> None:
    """Raise ValueError, naming the key and what to do, for arguments the capture cannot take."""
    owned = sorted(set(vllm_kwargs) & set(OWNED_KWARGS))
    if owned:
        raise ValueError(f"vllm_kwargs may not set {owned}: the vLLM backend sets them to "
                         f"capture hidden states; pass the model path and aux_layer_ids")
    if vllm_kwargs.get("enable_prefix_caching"):
        # A prefix served from the cache is not computed again, so the capture would have no
        # states of its own for it; vLLM 0.32's extract_hidden_states engine also never hit
        # the cache when asked (docs/backends.md, "Prefix caching").
        raise ValueError("vllm_kwargs enable_prefix_caching=True: a cached prefix's hidden "
                         "states are not captured again, so supervision cannot rely on it; "
                         "remove the key (the capture engine runs without prefix caching)")
    executor = vllm_kwargs.get("distributed_executor_backend", TP_EXECUTOR)
    if tp_size > 1 and executor != TP_EXECUTOR:
        raise ValueError(f"vllm_kwargs distributed_executor_backend={executor!r}: with "
                         f"tensor parallelism the replica holds its GPUs and vLLM runs its "
                         f"ranks as the replica's worker processes ({TP_EXECUTOR!r}, "
                         f"docs/architecture.md, \"Tensor parallelism\"); remove the key")


def capture_compilation_config(compilation_config: Any) -> Any:
    """`vllm_kwargs["compilation_config"]` (None, a mode number, a dict or vLLM's
    `CompilationConfig`) for a capture engine: the user's, with `UNVERIFIED_PASSES` turned off
    wherever the user left them to vLLM's defaults (a value the user set wins: vLLM's kwargs
    pass through)."""
    if compilation_config is None:
        compilation_config = {}
    if isinstance(compilation_config, int):
        compilation_config = {"mode": compilation_config}
    if not isinstance(compilation_config, Mapping):  # a CompilationConfig
        _turn_off_unverified(compilation_config.pass_config)
        return compilation_config
    compilation_config = dict(compilation_config)
    passes = compilation_config.get("pass_config") or {}
    if isinstance(passes, Mapping):
        compilation_config["pass_config"] = {**UNVERIFIED_PASSES, **passes}
    else:  # a PassConfig
        _turn_off_unverified(passes)
    return compilation_config


def _turn_off_unverified(pass_config: Any) -> None:
    for name, value in UNVERIFIED_PASSES.items():
        if getattr(pass_config, name) is None:  # None: vLLM decides
            setattr(pass_config, name, value)
