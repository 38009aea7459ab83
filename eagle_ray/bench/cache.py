"""Reading cached supervision vs generating it with the pool, and bytes on disk per token.

One vLLM replica (the tiny fp32 target) serves the same micro-batches that are then written to a
cache in each encoding dtype and read back, in one run.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import ray

from eagle_ray.bench import NAMESPACE, emit
from eagle_ray.contract.fp8 import ENCODING_DTYPES
from eagle_ray.contract.identity import TargetIdentity
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.data.supervision_cache import SupervisionCache, SupervisionCacheWriter
from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
from eagle_ray.testing import random_micro_batch


def run(model_path: str, micro_batches: int = 24, shape: tuple[int, int] = (8, 128)) -> None:
    if not ray.is_initialized():
        ray.init(num_cpus=4, object_store_memory=2**30, include_dashboard=False,
                 namespace=NAMESPACE, log_to_driver=False)
    pool = TargetPool.create(PoolConfig(model_path=model_path, dtype="float32", name="bench-cache",
                                        cpus_per_bundle=float(os.cpu_count() or 1),
                                        namespace=NAMESPACE))
    try:
        served: TargetIdentity = pool.identity()
        batch, seq = shape
        inputs = [random_micro_batch(served.vocab_size, (seq,) * batch, seed=i)
                  for i in range(micro_batches)]
        tokens = batch * seq * micro_batches
        client = pool.client(ClientConfig(max_inflight_micro_batches=4))
        list(client.stream(inputs[:2]))  # warm-up
        start = time.perf_counter()
        results = list(client.stream(inputs))
        generate_rate = tokens / (time.perf_counter() - start)
    finally:
        pool.shutdown()
    emit("cache", "supervision_tokens_per_s", round(generate_rate, 1), "tok/s",
         path="generate_with_pool", baseline="generate_with_pool", ratio=1.0)
    vocab = DraftVocab.from_target_ids(range(served.vocab_size), served.vocab_size)
    with tempfile.TemporaryDirectory() as tmp:
        for encoding_dtype in ENCODING_DTYPES:
            path = Path(tmp) / encoding_dtype
            writer = SupervisionCacheWriter(path, served, encoding_dtype)
            for result in results:
                writer.add(result)
            index = writer.close(vocab, [], {})
            cache = SupervisionCache.open(path)
            stream = cache.stream()
            start = time.perf_counter()
            for _ in range(micro_batches):
                next(stream)
            read_rate = tokens / (time.perf_counter() - start)
            emit("cache", "supervision_tokens_per_s", round(read_rate, 1), "tok/s",
                 path=f"read_cache_{encoding_dtype}", baseline="generate_with_pool",
                 ratio=round(read_rate / generate_rate, 2))
            on_disk = sum(f.stat().st_size for f in path.iterdir())
            emit("cache", "bytes_on_disk_per_token", round(on_disk / index["tokens"], 1),
                 "B/token", encoding_dtype=encoding_dtype, hidden_dtype=index["hidden_dtype"],
                 hidden_size=served.hidden_size)
