"""One engine fed by many request threads: a replica that never idles.

A replica accepts several calls at once (its `generate` concurrency group), each with one
micro-batch or several. Their request threads check and decode inputs and encode results; only
the engine thread here touches the engine. Micro-batches that wait together are merged into one
engine call, so they share engine steps (vLLM schedules their rows together), up to `max_tokens`
padded slots per call; anything else (text generation) runs alone, in arrival order. While the
engine runs one call, the results of the previous one travel back and the next inputs arrive: no
gap between engine calls.

Merging is exact: rows are independent (right padding, causal attention, the shift is per row),
so each micro-batch's slice of the merged result is what it would have got alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from eagle_ray.pool.protocol import EngineStats
from eagle_ray.target_batch import Eagle3TargetBatch

MicroBatch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids, attention, loss [B, S]


@dataclasses.dataclass
class _Job:
    future: Future
    micro_batch: MicroBatch | None = None  # merged with its neighbours
    call: Callable[[], Any] | None = None  # runs alone


class EngineQueue:
    """Serialises engine work from many threads and merges waiting micro-batches.

    `generate(micro_batch) -> Eagle3TargetBatch` runs a (merged) micro-batch on the engine
    (`generate_many` queues micro-batches, `call` anything else);
    `run_guarded(call)` wraps every engine call (the replica's failure handling). `stats` counts
    engine calls, the micro-batches they carried, the jobs waiting or on the engine now
    (`inside`), and the seconds the engine was busy (`busy_s`: its utilisation over time).
    """

    def __init__(self, generate: Callable[[MicroBatch], Eagle3TargetBatch],
                 run_guarded: Callable[[Callable[[], Any]], Any], max_tokens: int,
                 name: str = "engine") -> None:
        self._generate = generate
        self._run_guarded = run_guarded
        self.max_tokens = max_tokens
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wake = threading.Condition()
        self.stats = EngineStats()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def generate_many(self, micro_batches: list[MicroBatch]
                      ) -> list[Eagle3TargetBatch | BaseException]:
        """Supervision for checked micro-batches queued together (so they merge), each answer
        its result or the error of its engine call (blocks until all are done)."""
        jobs = [_Job(Future(), micro_batch=micro_batch) for micro_batch in micro_batches]
        self._wait(jobs)
        return [job.future.exception() or job.future.result() for job in jobs]

    def call(self, call: Callable[[], Any]) -> Any:
        """Run `call` on the engine thread, alone (blocks until done)."""
        job = _Job(Future(), call=call)
        self._wait([job])
        return job.future.result()

    def _wait(self, jobs: list[_Job]) -> None:
        with self._wake:
            self._jobs.extend(jobs)
            self.stats.inside += len(jobs)
            self._wake.notify()
        try:
            concurrent.futures.wait([job.future for job in jobs])
        finally:
            with self._wake:
                self.stats.inside -= len(jobs)

    def _next_jobs(self) -> list[_Job]:
        """The next call alone, or the waiting micro-batches in a row that fit `max_tokens`
        together (the first one always fits)."""
        with self._wake:
            while not self._jobs:
                self._wake.wait()
            first = self._jobs.popleft()
            if first.call is not None:
                return [first]
            jobs, rows, seq = [first], first.micro_batch[0].shape[0], first.micro_batch[0].shape[1]
            while self._jobs and self._jobs[0].micro_batch is not None:
                ids = self._jobs[0].micro_batch[0]
                merged_rows, merged_seq = rows + ids.shape[0], max(seq, ids.shape[1])
                if merged_rows * merged_seq > self.max_tokens:
                    break
                jobs.append(self._jobs.popleft())
                rows, seq = merged_rows, merged_seq
            return jobs

    def _loop(self) -> None:
        while True:
            jobs = self._next_jobs()
            started = time.perf_counter()
            try:
                results = self._run(jobs)
            except BaseException as e:  # noqa: BLE001 -- every waiter gets the engine's error
                for job in jobs:
                    job.future.set_exception(e)
                continue
            finally:
                self.stats.busy_s += time.perf_counter() - started
            for job, result in zip(jobs, results, strict=True):
                job.future.set_result(result)

    def _run(self, jobs: list[_Job]) -> list[Any]:
        """One engine call for `jobs` (a call alone, or micro-batches merged); their results."""
        self.stats.engine_calls += 1
        if jobs[0].call is not None:
            return [self._run_guarded(jobs[0].call)]
        parts = [job.micro_batch for job in jobs]
        merged = self._run_guarded(lambda: self._generate(merge_micro_batches(parts)))
        self.stats.micro_batches += len(jobs)
        self.stats.merged_calls += len(jobs) > 1
        return split_batch(merged, parts)


def merge_micro_batches(parts: list[MicroBatch]) -> MicroBatch:
    """Right-pad every part to the longest and stack their rows (one part: itself)."""
    if len(parts) == 1:
        return parts[0]
    seq = max(p[0].shape[1] for p in parts)
    return tuple(torch.cat([torch.nn.functional.pad(p[i], (0, seq - p[i].shape[1]))
                            for p in parts]) for i in range(3))


def split_batch(batch: Eagle3TargetBatch, parts: list[MicroBatch]) -> list[Eagle3TargetBatch]:
    """Each part's rows and positions of a merged result (`merge_micro_batches`)."""
    if len(parts) == 1:
        return [batch]
    out, row = [], 0
    for ids, _, _ in parts:
        rows, seq = ids.shape
        out.append(Eagle3TargetBatch(**{name: t[row:row + rows, :seq]
                                        for name, t in batch.tensors().items()}))
        row += rows
    return out
