"""`eagle-ray cache --config JOB.yaml`: the pool's supervision for the job's data, written once to
`data.supervision_cache` (`eagle_ray.data.supervision_cache`), so training needs no target.

The data goes through the job's own path (read, regenerate if enabled, tokenise, hold out, draft
vocabulary), then one pass of token-budget micro-batches streams through the pool, every replica
busy, into safetensors shards. Training with the same `data.supervision_cache` reads them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from eagle_ray.config import ClientConfig, ConfigError, JobConfig
from eagle_ray.data.supervision_cache import SHARD_BYTES, SupervisionCacheWriter
from eagle_ray.data.tokenizer_files import load_tokenizer

logger = logging.getLogger(__name__)


def run_cache(config: JobConfig, log_to_driver: bool = True,
              shard_bytes: int = SHARD_BYTES) -> dict[str, Any]:
    """Write the cache; returns its summary (micro-batches, tokens, bytes per token, seconds)."""
    from tqdm import tqdm

    from eagle_ray.data.ingest import prepare_job_data
    from eagle_ray.driver import check_paths, init_ray, job_pool
    from eagle_ray.resources import check_job_resources
    from eagle_ray.train.loop import epoch_micro_batches

    if not config.data.supervision_cache:
        raise ConfigError("eagle-ray cache writes to data.supervision_cache: set it to a folder "
                          "(shared storage on a cluster), e.g. data.supervision_cache=runs/cache")
    check_paths(config)
    output_dir = Path(config.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    init_ray(config, log_to_driver)
    check_job_resources(config)
    with job_pool(config) as (pool, served):
        writer = SupervisionCacheWriter(config.data.supervision_cache, served,
                                        config.target.encoding_dtype, shard_bytes)
        tokenizer_at, tokenizer = load_tokenizer(
            config.target.model_path or served.model_path, config.target.vllm_kwargs,
            "eagle-ray cache (it renders the chat data)")
        data = prepare_job_data(config, served, tokenizer_at, tokenizer,
                                pool.client(ClientConfig(max_inflight_micro_batches=16)),
                                output_dir)
        replicas = max(len(pool.pool_status().replicas), 1)
        client = pool.client(ClientConfig(max_inflight_micro_batches=4 * replicas))
        started = time.perf_counter()
        micro_batches = epoch_micro_batches(data.train, config.data,
                                            tokenizer.pad_token_id or 0, config.train.seed)
        for batch in tqdm(client.stream(micro_batches), desc="supervision cache",
                          unit=" micro-batches", total=None, mininterval=2.0):
            writer.add(batch)
        index = writer.close(data.vocab, data.held_out, data.statuses)
    seconds = time.perf_counter() - started
    return {"supervision_cache": str(Path(config.data.supervision_cache).resolve()),
            "micro_batches": len(index["micro_batches"]), "tokens": index["tokens"],
            "bytes_per_token": round(index["bytes"] / max(index["tokens"], 1), 1),
            "encoding_dtype": index["encoding_dtype"], "seconds": round(seconds, 1),
            "target": served.describe()}
