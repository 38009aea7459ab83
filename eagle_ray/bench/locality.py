"""Locality: supervision throughput with locality-aware routing on vs off, on two Ray nodes.

Each node holds one replica and one trainer (the placement plan, docs/architecture.md, "Locality"),
laid out with the same custom resources a GPU cluster uses. Replicas run the fixed-latency backend
with a hidden size that gives 32 KiB of supervision per token (what an 8B target emits in bf16), so
the run is bound by moving results, which is what locality changes.
"""

from __future__ import annotations

import time

import ray
import torch

from eagle_ray.bench import NAMESPACE, SYNTHETIC, emit
from eagle_ray.bench.transport import simulated_nodes
from eagle_ray.pool import ClientConfig, PoolClient, PoolConfig, TargetPool
from eagle_ray.testing import random_micro_batch

VOCAB = 1024
PLAN = {"target_slot": 1, "trainer_slot": 1}  # per node: one replica, one trainer


@ray.remote(num_cpus=0, resources={"trainer_slot": 1})
class _Trainer:
    """Streams micro-batches from the pool and reads every byte of each result, as a training
    step would when it copies supervision to its GPU."""

    def __init__(self, pool_name: str, window: int) -> None:
        self.client = PoolClient.connect(pool_name, NAMESPACE, ClientConfig(
            max_inflight_micro_batches=window, max_inflight_tokens=1 << 30))

    def run(self, count: int, tokens: int, seed: int) -> int:
        batches = [random_micro_batch(VOCAB, (tokens,), seed=seed * 1000 + i)
                   for i in range(count)]
        read = 0
        for batch in self.client.stream(batches):
            read += sum(t.numel() for t in batch.tensors().values()
                        if bool(torch.isfinite(t.float().sum())))
        return read


def _throughput(locality: bool, count: int, tokens: int, hidden: int, window: int
                ) -> tuple[float, float]:
    """Supervision tokens/s of both trainers together, and the pool's on-node share."""
    name = f"bench-locality-{'on' if locality else 'off'}"
    pool = TargetPool.create(PoolConfig(
        backend=SYNTHETIC, name=name, namespace=NAMESPACE, replicas=2, cpus_per_bundle=0.5,
        bundle_resources={"target_slot": 1}, locality=locality,
        backend_kwargs={"hidden_size": hidden, "vocab_size": VOCAB}))
    try:
        trainers = [_Trainer.remote(name, window) for _ in range(2)]
        ray.get([t.run.remote(2, tokens, seed=99) for t in trainers])  # warm-up
        start = time.perf_counter()
        ray.get([t.run.remote(count, tokens, seed=s) for s, t in enumerate(trainers)])
        seconds = time.perf_counter() - start
        share = pool.status()["on_node_share"]
        for trainer in trainers:
            ray.kill(trainer)
        return 2 * count * tokens / seconds, share
    finally:
        pool.shutdown()


def run(count: int = 24, tokens: int = 1024, hidden: int = 2048, window: int = 2,
        rounds: int = 2) -> None:
    """Locality on vs off, interleaved `rounds` times (best of each), side by side."""
    bytes_per_token = 4 * hidden * 4  # three aux states and the last hidden state, float32
    with simulated_nodes(2, object_store_mb=1024, num_cpus=2, resources=PLAN):
        results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
        for _ in range(rounds):
            for locality in (True, False):
                results[locality].append(_throughput(locality, count, tokens, hidden, window))
        best = {locality: max(runs) for locality, runs in results.items()}
        for locality, (rate, share) in best.items():
            emit("locality", "supervision_tokens_per_s", round(rate, 1), "tok/s",
                 locality="on" if locality else "off", on_node_share=share,
                 bytes_per_s=round(rate * bytes_per_token), mb_per_micro_batch=round(
                     tokens * bytes_per_token / 2**20, 1), baseline="off",
                 ratio=round(rate / best[False][0], 3))
