"""Draft-training throughput with the target's vLLM engine in the trainer's process vs the same
engine as a one-replica pool, like for like, in one run.

Both paths train the same draft from the same initial weights on the same micro-batches, with the
same prefetch depth (the co-located engine runs one step ahead in a background thread, as the
pool client's window does), after the same warm-up, in interleaved rounds so drift on a shared
machine hits both alike. Only where the engine runs differs. Reports training tokens/s (best
round) and the share of step time spent waiting on supervision.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Iterator

import ray
import torch

from eagle_ray.bench import NAMESPACE, emit
from eagle_ray.bench.pool import _start_ray
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss


def prefetched(backend, micro_batches: Iterable, depth: int) -> Iterator[Eagle3TargetBatch]:
    """Supervision from an in-process backend, computed up to `depth` micro-batches ahead in a
    background thread (the co-located counterpart of the pool client's in-flight window)."""
    ready: queue.Queue = queue.Queue(maxsize=depth)
    done = object()

    def produce() -> None:
        for batch in micro_batches:
            ready.put(backend.generate_batch(*batch))
        ready.put(done)

    threading.Thread(target=produce, daemon=True).start()
    while (item := ready.get()) is not done:
        yield item


def _train(draft: Eagle3Draft, head, vocab: DraftVocab,
           supervision: Iterator[Eagle3TargetBatch], steps: int) -> tuple[float, float]:
    """(tokens/s, wait share) of `steps` TTT steps fed by `supervision`."""
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    waited, tokens = 0.0, 0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(supervision)
        waited += time.perf_counter() - t0
        probs, mask = draft_target(batch, vocab, head)
        loss, _, _ = ttt_loss(draft, batch.aux_hidden_states.float(), batch.input_ids,
                              batch.loss_mask, probs, mask, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tokens += int(batch.attention_mask.sum())
    elapsed = time.perf_counter() - start
    return tokens / elapsed, waited / elapsed


def run(model_path: str, steps: int = 20, rounds: int = 3, batch: int = 8, seq: int = 256,
        prefetch: int = 4) -> None:
    from transformers import AutoConfig

    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
    from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
    from eagle_ray.testing import random_micro_batch

    colocated = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32")
    vocab = DraftVocab.from_token_counts(torch.ones(colocated.vocab_size),
                                         min(256, colocated.vocab_size))
    draft_config = DraftConfig.from_target(AutoConfig.from_pretrained(model_path), vocab.size)
    embedding = colocated.get_input_embeddings().weight.detach()
    head = colocated.get_target_head()
    micro_batches = [random_micro_batch(colocated.vocab_size, (seq,) * batch, seed=i)
                     for i in range(steps)]
    _start_ray()
    pool = TargetPool.create(PoolConfig(model_path=model_path, dtype="float32",
                                        name="bench-train", namespace=NAMESPACE))
    client = pool.client(ClientConfig(max_inflight_micro_batches=prefetch))
    sources = {
        "colocated_vllm": lambda batches: prefetched(colocated, batches, prefetch),
        "pool_vllm_1_replica": lambda batches: client.stream(batches),
    }
    results: dict[str, list[tuple[float, float]]] = {path: [] for path in sources}
    try:
        warm = min(3, steps)
        for source in sources.values():  # warm-up: engines, caches, the draft's kernels
            torch.manual_seed(0)
            _train(Eagle3Draft(draft_config, embedding), head, vocab,
                   source(micro_batches[:warm]), warm)
        for _ in range(rounds):  # interleaved
            for path, source in sources.items():
                torch.manual_seed(0)
                draft = Eagle3Draft(draft_config, embedding)
                results[path].append(_train(draft, head, vocab, source(micro_batches), steps))
    finally:
        pool.shutdown()
        colocated.shutdown()
        ray.shutdown()
    best = {path: max(runs) for path, runs in results.items()}
    for path, (rate, wait) in best.items():
        emit("train", "training_tokens_per_s", round(rate, 1), "tok/s", path=path, batch=batch,
             seq=seq, prefetch=prefetch, rounds=rounds, baseline="colocated_vllm",
             ratio=round(rate / best["colocated_vllm"][0], 3))
        emit("train", "supervision_wait_share", round(wait, 3), "fraction", path=path)
