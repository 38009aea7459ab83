"""A job's engines sized from what the job sends them, not from the checkpoint.

A Llama-3.1 checkpoint says `max_position_embeddings: 131072`; an engine started with that
`max_model_len` must fit one 131,072-token request in its KV cache before it serves anything,
which the CPU default budget (512 MiB) refuses even for a tiny Llama-3.1-shaped target, and on
a GPU it reserves for a length a 4,096-token job never sends. A job knows its longest
sequence: training rows of `data.max_length`, and regeneration and evaluation prompts (rows of
the same data) plus their new tokens. Engines get that (vLLM: plus the one token it samples,
unless the job sets `target.vllm_kwargs.max_model_len` itself; `engines.Engine.sized_for`).
"""

from __future__ import annotations

from eagle_ray.backends.engines import ENGINES
from eagle_ray.config import ConfigError, JobConfig, PoolConfig


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
