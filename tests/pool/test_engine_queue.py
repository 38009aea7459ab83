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

    def run_engine(self, micro_batch):
        self.calls.append(micro_batch[0].shape)
        if len(self.calls) == 1:
            self.entered.set()
            assert self.release.wait(30)
        return self.target.run_engine(*micro_batch)

    def finish(self, engine_output):
        return self.target.finish_batch(engine_output)


def run_threads(queue, parts):
    results = [None] * len(parts)

    def one(i):
        (results[i],) = queue.generate_many([parts[i]])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(parts))]
    return threads, results


def test_micro_batches_waiting_together_share_one_call_within_the_token_cap(hf_target):
    engine = GatedEngine(hf_target)
    queue = EngineQueue(engine.run_engine, engine.finish, lambda call: call(), max_tokens=3 * 64)
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
    engine_s, host_s = stats.pop("engine_s"), stats.pop("host_s")
    assert stats == {"engine_calls": 3, "micro_batches": 5, "merged_calls": 1, "inside": 0,
                     "handoff_overflows": 0, "engine_restarts": 0, "nonfinite_refused": 0}
    assert engine_s > 0 and host_s > 0
    for part, got in zip(parts, results, strict=True):
        torch.testing.assert_close(got.aux_hidden_states,
                                   hf_target.generate_batch(*part).aux_hidden_states,
                                   rtol=1e-5, atol=1e-5)


def test_an_engine_error_reaches_every_micro_batch_of_the_call_and_the_queue_goes_on():
    calls = []

    def run_engine(micro_batch):
        calls.append(micro_batch[0].shape[0])
        if len(calls) == 1:
            raise RuntimeError("engine broke")
        return FakeBatch(micro_batch)

    queue = EngineQueue(run_engine, lambda output: output, lambda call: call(),
                        max_tokens=1 << 20)
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


class PipelineProbe:
    """An engine and a host stage that record, per engine call, how many finished calls were
    still waiting for the host stage when it started, and whether the host stage was busy with
    an earlier call meanwhile; the host stage holds its first call until `release`."""

    def __init__(self) -> None:
        self.queue: EngineQueue | None = None
        self.host_busy = threading.Event()
        self.release = threading.Event()
        self.waiting_at_start: list[int] = []
        self.overlapped: list[bool] = []
        self.finished_on: list[str] = []

    def run_engine(self, micro_batch):
        finished = self.queue._finished
        self.waiting_at_start.append(finished.unfinished_tasks if finished else 0)
        self.overlapped.append(self.host_busy.is_set())
        return FakeBatch(micro_batch)

    def finish(self, output):
        self.finished_on.append(threading.current_thread().name)
        if len(self.finished_on) == 1:
            self.host_busy.set()
            assert self.release.wait(30)
            self.host_busy.clear()
        return output


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_engine_runs_the_next_call_while_the_host_stage_finishes_one(pipelined):
    probe = PipelineProbe()
    probe.queue = EngineQueue(probe.run_engine, probe.finish, lambda call: call(),
                              max_tokens=8, name="engine", pipelined=pipelined)
    threads = [threading.Thread(target=probe.queue.generate_many,
                                args=([random_micro_batch(100, (8,), seed=i)],))
               for i in range(4)]
    threads[0].start()
    assert probe.host_busy.wait(30) or not pipelined
    for thread in threads[1:]:
        thread.start()
    if pipelined:
        # The engine takes the second call while the host stage still holds the first.
        wait_until(lambda: len(probe.waiting_at_start) >= 2, what="a second engine call")
    probe.release.set()
    for thread in threads:
        thread.join(60)
    assert len(probe.finished_on) == 4
    if pipelined:
        assert probe.overlapped[1], "the second engine call ran beside the first's host stage"
        assert set(probe.finished_on) == {"engine-host"}
    else:  # the control: one thread does both, so the engine never runs beside the host stage
        assert not any(probe.overlapped) and set(probe.finished_on) == {"engine"}
    # Bounded: no engine call starts while a finished one still waits for the host stage.
    assert probe.waiting_at_start == [0] * len(probe.waiting_at_start)
