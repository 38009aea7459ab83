"""The replica's engine queue: waiting micro-batches are merged into one engine call, exactly."""

import dataclasses
import threading

import pytest
import torch

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.pool.engine_queue import EngineQueue, merge_micro_batches, split_batch
from eagle_ray.testing import random_micro_batch

from pool_helpers import wait_until


@pytest.fixture(scope="module")
def hf_target(llama_path):
    return HFEagle3TargetModel.from_pretrained(llama_path, dtype=torch.float32)


def test_a_merged_call_gives_each_micro_batch_what_it_gets_alone(hf_target):
    parts = [random_micro_batch(hf_target.vocab_size, lengths, seed=i)
             for i, lengths in enumerate([(17, 9, 30, 4), (64,), (5, 40, 12)])]
    merged = hf_target.generate_batch(*merge_micro_batches(parts))
    for part, got in zip(parts, split_batch(merged, parts), strict=True):
        alone = hf_target.generate_batch(*part)
        assert got.tensors().keys() == alone.tensors().keys()
        for name, tensor in alone.tensors().items():
            torch.testing.assert_close(got.tensors()[name], tensor, rtol=1e-5, atol=1e-5,
                                       msg=name)


class GatedEngine:
    """Records what each engine call received; the first call waits for `release`."""

    def __init__(self, target) -> None:
        self.target, self.calls = target, []
        self.entered, self.release = threading.Event(), threading.Event()

    def generate(self, micro_batch):
        self.calls.append(micro_batch[0].shape)
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(30)
        return self.target.generate_batch(*micro_batch)


def run_threads(queue, parts):
    results = [None] * len(parts)

    def one(i):
        (results[i],) = queue.generate_many([parts[i]])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(parts))]
    return threads, results


def test_micro_batches_waiting_together_share_one_call_within_the_token_cap(hf_target):
    engine = GatedEngine(hf_target)
    queue = EngineQueue(engine.generate, lambda call: call(), max_tokens=3 * 64)
    parts = [random_micro_batch(hf_target.vocab_size, (64,), seed=i) for i in range(5)]
    threads, results = run_threads(queue, parts)
    threads[0].start()
    assert engine.entered.wait(30)  # the first is on the engine; four wait behind it
    for t in threads[1:]:
        t.start()
    # All five inside (one on the engine, four waiting): the queue's own count, bounded.
    wait_until(lambda: queue.stats.inside == 5, what="four micro-batches waiting")
    engine.release.set()
    for t in threads:
        t.join(60)
    # 1 alone, then 3 merged (3 x 64 slots is the cap), then the last one.
    assert [tuple(s) for s in engine.calls] == [(1, 64), (3, 64), (1, 64)]
    stats = dataclasses.asdict(queue.stats)
    busy = stats.pop("busy_s")
    assert stats == {"engine_calls": 3, "micro_batches": 5, "merged_calls": 1, "inside": 0}
    assert busy > 0
    for part, got in zip(parts, results, strict=True):
        torch.testing.assert_close(got.aux_hidden_states,
                                   hf_target.generate_batch(*part).aux_hidden_states,
                                   rtol=1e-5, atol=1e-5)


def test_an_engine_error_reaches_every_micro_batch_of_the_call_and_the_queue_goes_on():
    calls = []

    def generate(micro_batch):
        calls.append(micro_batch[0].shape[0])
        if len(calls) == 1:
            raise RuntimeError("engine broke")
        return FakeBatch(micro_batch)

    queue = EngineQueue(generate, lambda call: call(), max_tokens=1 << 20)
    answers = queue.generate_many([random_micro_batch(100, (8,)), random_micro_batch(100, (5,))])
    assert len(calls) == 1, "the two were merged into one engine call"
    assert all(isinstance(a, RuntimeError) and "engine broke" in str(a) for a in answers)
    assert queue.call(lambda: "text generation runs alone") == "text generation runs alone"
    (answer,) = queue.generate_many([random_micro_batch(100, (8, 3))])
    assert answer.rows == 2


class FakeBatch:
    def __init__(self, micro_batch) -> None:
        self.rows = micro_batch[0].shape[0]


def test_merge_pads_every_part_to_the_longest_row_with_nothing_attended():
    a, b = random_micro_batch(50, (3,), seed=0), random_micro_batch(50, (7, 2), seed=1)
    ids, attention, loss = merge_micro_batches([a, b])
    assert ids.shape == (3, 7)
    assert attention.sum() == 3 + 7 + 2 and loss[0, 3:].sum() == 0
    assert torch.equal(ids[1:], b[0])
