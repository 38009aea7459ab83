"""A job's engines sized from what the job sends them, not from the checkpoint.

A Llama-3.1 checkpoint says `max_position_embeddings: 131072`; an engine started with that
`max_model_len` must fit one 131,072-token request in its KV cache before it serves anything,
which the CPU default budget (512 MiB) refuses even for a tiny Llama-3.1-shaped target, and on
a GPU it reserves for a length a 4,096-token job never sends. A job knows its longest
sequence: training rows of `data.max_length`, and regeneration and evaluation prompts (rows of
the same data) plus their new tokens. Engines get that (vLLM: plus the one token it samples,
unless the job sets `target.vllm_kwargs.max_model_len` itself; `engines.Engine.sized_for`).

What a vLLM engine's KV cache holds per token is computed here as vLLM 0.32's own KV-cache specs
count it (`kv_cache_bytes_per_token`, tested against vLLM's spec classes), and what vLLM reserves
before it sizes the cache, which only a GPU can profile, is a stated assumption
(`engine_reserves`); `eagle-ray plan` adds them up.
"""

from __future__ import annotations

from typing import Any

from eagle_ray.backends.engines import ENGINES
from eagle_ray.config import ConfigError, JobConfig, PoolConfig

ACTIVATION_BYTES_PER_BATCHED_TOKEN = 160 * 2**10
"""An assumption (no GPU has measured it for eagle_ray): vLLM's profile run forwards
`max_num_batched_tokens` tokens and samples, and takes its peak from the KV cache's budget
(`Worker.determine_available_memory`). 160 KiB per batched token on every rank: vLLM's
profiling log of Llama-3-8B on an H100 (vllm-project/vllm#10511) reports a 1.26 GiB peak at
8,192 batched tokens, at TP 1 and TP 2 alike, so the figure is not divided by TP."""
CUDA_GRAPH_POOL_BYTES = 2**30
"""An assumption (no GPU has measured it for eagle_ray): vLLM 0.32 captures CUDA graphs unless
`enforce_eager`, and takes its estimate of their pool from the KV cache's budget
(`GPUModelRunner.profile_cudagraph_memory`: the largest graph's capture plus at least 1 MiB for
each further capture size; `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` is on by default). 1 GiB
per rank."""
# vLLM 0.32's `max_num_batched_tokens` for `vllm.LLM` when not set (EngineArgs.get_batch_defaults):
# 16,384 on GPUs of 70 GiB and more but the A100 (not told apart here: the larger reserve), else
# 8,192.
LARGE_GPU_GIB, LARGE_GPU_BATCHED_TOKENS, BATCHED_TOKENS = 70, 16384, 8192


def longest_sequence(job: JobConfig) -> int:
    """Tokens of the longest sequence the job sends a target engine (prompt + new tokens)."""
    longest = job.data.max_length
    if job.regenerate.enabled:
        longest = max(longest, job.data.max_length + job.regenerate.max_new_tokens)
    if job.eval.enabled:
        longest = max(longest, job.data.max_length + job.eval.max_new_tokens)
    return longest


def sized_pool_config(job: JobConfig) -> PoolConfig:
    """`job.target` with its engines sized for `longest_sequence` (a factory backend as it is)."""
    engine = ENGINES.get(job.target.backend)
    return job.target if engine is None else engine.sized_for(job.target, longest_sequence(job))


def check_rows_fit(job: JobConfig, pool_max_length: int | None) -> None:
    """A shared pool whose engines accept shorter rows than the job's is refused before
    training, with both numbers (a job's own pool is sized for it)."""
    if pool_max_length is not None and job.data.max_length > pool_max_length:
        raise ConfigError(
            f"data.max_length is {job.data.max_length} tokens but the shared pool "
            f"{job.target.name!r} accepts rows of at most {pool_max_length} (its engines' "
            f"max_model_len {pool_max_length + 1}): lower data.max_length to {pool_max_length}, "
            f"or restart the pool with target.vllm_kwargs.max_model_len >= "
            f"{longest_sequence(job) + 1}")


def kv_cache_bytes_per_token(text: Any, tp_size: int, dtype_bytes: int,
                             captured_states: int) -> dict[str, int]:
    """Bytes one token takes in a vLLM replica's KV cache on each TP rank, as vLLM 0.32's specs
    count them (`page_size_bytes / block_size`; all of them share one block table): every
    attention layer's K and V for the rank's KV heads (at least one: ranks past the model's KV
    heads hold copies), or latent attention's one latent per layer on every rank; and the
    `extract_hidden_states` capture layer (`HiddenStateCacheSpec`), the token's
    `captured_states` hidden states whole on every rank. At the target's dtype (`kv_cache_dtype`
    "auto"). Exact where every attention layer has one spec (every shipped recipe); with mixed
    layers (sliding windows, hybrids) vLLM groups them and pads the capture layer's pages to the
    widest group's, which this does not model: it then overstates the tokens the cache holds.
    `text`: the target's transformers text config."""
    if getattr(text, "kv_lora_rank", None):
        attention = text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim)
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        attention = 2 * text.num_hidden_layers * max(1, kv_heads // tp_size) * head_dim
    parts = {"attention": attention * dtype_bytes,
             "captured_states": captured_states * text.hidden_size * dtype_bytes}
    return {**parts, "total": sum(parts.values())}


def batched_tokens(vllm_kwargs: dict[str, Any], gpu_memory_gib: float) -> int:
    """The engine's `max_num_batched_tokens`: the job's, else vLLM's default for the GPU."""
    if vllm_kwargs.get("max_num_batched_tokens"):
        return int(vllm_kwargs["max_num_batched_tokens"])
    return LARGE_GPU_BATCHED_TOKENS if gpu_memory_gib >= LARGE_GPU_GIB else BATCHED_TOKENS


def engine_reserves(vllm_kwargs: dict[str, Any], gpu_memory_gib: float) -> dict[str, int]:
    """Bytes per rank vLLM takes from `gpu_memory_utilization`'s budget for its own work before
    it sizes the KV cache: the profile run's activations and the CUDA-graph pool (the module's
    assumed figures)."""
    graphs = 0 if vllm_kwargs.get("enforce_eager") else CUDA_GRAPH_POOL_BYTES
    return {"activations": batched_tokens(vllm_kwargs, gpu_memory_gib)
            * ACTIVATION_BYTES_PER_BATCHED_TOKEN, "cuda_graphs": graphs}


def gpu_engine_kwargs(pool: PoolConfig) -> dict[str, Any]:
    """The vLLM keyword arguments a replica's engine starts with on a GPU."""
    from eagle_ray.backends.vllm.runner import GPU_DEFAULTS

    return {**GPU_DEFAULTS, **pool.vllm_kwargs}


def reserve_assumptions(pool: PoolConfig, gpu_memory_gib: float) -> dict[str, Any]:
    """The assumed figures behind a replica's `engine_reserves`, for `eagle-ray plan`'s output."""
    return {"max_num_batched_tokens": batched_tokens(gpu_engine_kwargs(pool), gpu_memory_gib),
            "activation_kib_per_batched_token": ACTIVATION_BYTES_PER_BATCHED_TOKEN // 2**10,
            "cuda_graph_pool_gib": CUDA_GRAPH_POOL_BYTES / 2**30,
            "replica_reserves_from": "assumed (vLLM profiles them on the GPU; no GPU "
                                     "measurement yet)"}
