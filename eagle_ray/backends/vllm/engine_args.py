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
