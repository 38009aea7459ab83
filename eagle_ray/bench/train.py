"""Draft-training throughput fed by the pool vs by a co-located HF target, in one run.

Both paths train the same draft (same initial weights) on the same micro-batches in this process;
only where the supervision comes from differs. Reports training tokens/s and the share of step
time spent waiting on supervision.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import ray
import torch

from eagle_ray.bench import emit
from eagle_ray.bench.pool import _start_ray
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, ttt_loss
from eagle_ray.supervision import DraftVocab, draft_target
from eagle_ray.target_batch import Eagle3TargetBatch


def _train(draft_config: DraftConfig, embedding: torch.Tensor, head, vocab: DraftVocab,
           supervision: Iterator[Eagle3TargetBatch], steps: int) -> tuple[float, float]:
    """(tokens/s, wait share) of `steps` TTT steps fed by `supervision`."""
    torch.manual_seed(0)
    draft = Eagle3Draft(draft_config, embedding)
    optimizer = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=1e-3)
    waited, tokens = 0.0, 0
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        batch = next(supervision)
        waited += time.perf_counter() - t0
        probs, mask = draft_target(batch, vocab, head)
        loss, _, _ = ttt_loss(draft, batch.aux_hidden_states.float(), batch.input_ids,
                              batch.attention_mask, batch.loss_mask, probs, mask, ttt_steps=3)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        tokens += int(batch.attention_mask.sum())
    elapsed = time.perf_counter() - start
    return tokens / elapsed, waited / elapsed


def run(model_path: str, steps: int = 30, batch: int = 8, seq: int = 256) -> None:
    from eagle_ray.hf_target import HFEagle3TargetModel
    from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool
    from eagle_ray.testing import random_micro_batch

    hf = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    vocab = DraftVocab.from_token_counts(torch.ones(hf.vocab_size), min(256, hf.vocab_size))
    draft_config = DraftConfig.from_target(hf.model.config, vocab.size)
    embedding = hf.get_input_embeddings().weight.detach()
    micro_batches = [random_micro_batch(hf.vocab_size, (seq,) * batch, seed=i)
                     for i in range(steps)]
    colocated = _train(draft_config, embedding, hf.get_target_head(), vocab,
                       (hf.generate_batch(*b) for b in micro_batches), steps)
    _start_ray()
    pool = TargetPool.create(PoolConfig(model_path=model_path, dtype="float32",
                                        name="bench-train", namespace="eagle_ray_bench"))
    try:
        client = pool.client(ClientConfig(max_inflight_micro_batches=4))
        pooled = _train(draft_config, embedding, hf.get_target_head(), vocab,
                        client.stream(micro_batches), steps)
    finally:
        pool.shutdown()
        ray.shutdown()
    for path, (rate, wait) in (("colocated_hf", colocated), ("pool_vllm_1_replica", pooled)):
        emit("train", "training_tokens_per_s", round(rate, 1), "tok/s", path=path, batch=batch,
             seq=seq, baseline="colocated_hf", ratio=round(rate / colocated[0], 3))
        emit("train", "supervision_wait_share", round(wait, 3), "fraction", path=path)
