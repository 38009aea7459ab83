"""One engine fed by many request threads, and a host stage beside it: a replica that never idles.

A replica accepts several calls at once (its `generate` concurrency group), each with one
micro-batch or several. Their request threads check and decode inputs and hand results to Ray;
the work in between runs in two stages of a pipeline:

- the **engine thread** runs only the engine (`run_engine`: the forward and the copies the engine
  itself must make). Micro-batches that wait together are merged into one engine call, so they
  share engine steps (vLLM schedules their rows together), up to `max_tokens` padded slots per
  call; anything else (text generation) runs alone, in arrival order.
- the **host thread** turns each engine call's output into supervision (`finish`: padding, the
  shift, head decoding, fp8) while the engine thread already runs the next call.

The stages are bounded: the engine thread starts a call only when no finished call is waiting
for the host stage, so at most two calls' captured states exist at once (the one the host stage
reads, the one the engine writes), which sizes the vLLM hand-off's ring
(`backends/vllm/ring_files.py`). With `pipelined=False` the engine thread does both stages, one
after the other (the design before this one, kept as the benchmark's baseline).

Merging is exact: rows are independent (right padding, causal attention, the shift is per row),
so each micro-batch's slice of the merged result is what it would have got alone.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from eagle_ray.contract.images import ImageInputs, MicroBatch
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool.failures import FailureKind, classify, free_memory
from eagle_ray.pool.protocol import EngineStats, MicroBatchOutOfMemory


@dataclasses.dataclass
class _Job:
    future: Future
    micro_batch: MicroBatch | None = None  # merged with its neighbours (unless `alone`)
    call: Callable[[], Any] | None = None  # runs alone
    alone: bool = False  # a merged call it was in ran out of memory: it runs by itself


@dataclasses.dataclass
class _Finished:
    """An engine call's output on its way to the host stage."""

    jobs: list[_Job]
    parts: list[MicroBatch]
    engine_output: Any


class EngineQueue:
    """Serialises engine work from many threads, merges waiting micro-batches, and finishes
    each engine call's output on a second thread while the engine runs the next.

    `run_engine(micro_batch)` runs a (merged) micro-batch on the engine; `finish(output) ->
    Eagle3TargetBatch` turns what it returned into supervision (`RunnerEagle3TargetModel`'s
    `run_engine` and `finish_batch`). `generate_many` queues micro-batches, `call` anything else
    (run on the engine thread, alone); `run_guarded(call)` wraps every stage's work (the
    replica's failure handling); `recover()` runs on the engine thread after an engine call ran
    out of memory (the replica frees memory and checks its engine). A merged call that runs out
    of memory is run again micro-batch by micro-batch, so only the one too large fails (with
    `MicroBatchOutOfMemory`). `stats` counts engine calls, the micro-batches they carried,
    the calls that merged several, the jobs waiting or inside now, and the seconds each stage
    worked (`engine_s`, `host_s`: the engine's share of wall time is its utilisation). Out
    of memory in the host stage is handled as in the engine stage (memory freed, no engine
    check).
    """

    def __init__(self, run_engine: Callable[[MicroBatch], Any],
                 finish: Callable[[Any], Eagle3TargetBatch],
                 run_guarded: Callable[[Callable[[], Any]], Any], max_tokens: int,
                 name: str = "engine", pipelined: bool = True,
                 recover: Callable[[], None] = lambda: None) -> None:
        self._run_engine = run_engine
        self._finish = finish
        self._run_guarded = run_guarded
        self._recover = recover
        self.max_tokens = max_tokens
        self._jobs: collections.deque[_Job] = collections.deque()
        self._wake = threading.Condition()
        # At most one finished engine call waits for the host stage (`join` before each call).
        self._finished: queue.Queue[_Finished] | None = queue.Queue(maxsize=1) if pipelined \
            else None
        self._stats_lock = threading.Lock()
        self.stats = EngineStats()
        threading.Thread(target=self._engine_loop, name=name, daemon=True).start()
        if self._finished is not None:
            threading.Thread(target=self._host_loop, name=f"{name}-host", daemon=True).start()

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
            if first.call is not None or first.alone:
                return [first]
            jobs, rows, seq = [first], first.micro_batch[0].shape[0], first.micro_batch[0].shape[1]
            while self._jobs and self._jobs[0].micro_batch is not None \
                    and not self._jobs[0].alone:
                ids = self._jobs[0].micro_batch[0]
                merged_rows, merged_seq = rows + ids.shape[0], max(seq, ids.shape[1])
                if merged_rows * merged_seq > self.max_tokens:
                    break
                jobs.append(self._jobs.popleft())
                rows, seq = merged_rows, merged_seq
            return jobs

    def _engine_loop(self) -> None:
        while True:
            if self._finished is not None:
                self._finished.join()  # the host stage has taken the previous call
            self._engine_call(self._next_jobs())

    def _engine_call(self, jobs: list[_Job]) -> None:
        """One engine call for `jobs` (a call alone, or micro-batches merged); supervision goes
        on to the host stage (or is finished here when not pipelined)."""
        self._count(engine_calls=1)
        if jobs[0].call is not None:
            self._settle(jobs, lambda: [self._run_guarded(jobs[0].call)], "engine_s")
            return
        parts = [job.micro_batch for job in jobs]
        self._count(micro_batches=len(jobs), merged_calls=int(len(jobs) > 1))
        merged = merge_micro_batches(parts)
        output = self._timed(lambda: self._run_guarded(lambda: self._run_engine(merged)),
                             "engine_s")
        if isinstance(output, BaseException) and classify(output) is FailureKind.OUT_OF_MEMORY:
            self._out_of_memory(jobs, output)  # its answer first; then the replica frees
            self._recover()  # memory and checks its engine
            return
        if isinstance(output, BaseException):
            self._fail(jobs, output)
        elif self._finished is None:
            self._host_stage(_Finished(jobs, parts, output))
        else:
            self._finished.put(_Finished(jobs, parts, output))

    def _out_of_memory(self, jobs: list[_Job], error: BaseException) -> None:
        """A stage ran out of memory on `jobs`' call: merged micro-batches run again each
        alone, first in line, so only the one too large fails; a lone one fails with
        `MicroBatchOutOfMemory` (its size, what to change)."""
        if len(jobs) == 1:
            ids, attention = jobs[0].micro_batch[:2]
            self._fail(jobs, MicroBatchOutOfMemory.of(error, *ids.shape, int(attention.sum())))
            return
        with self._wake:
            for job in reversed(jobs):
                job.alone = True
                self._jobs.appendleft(job)
            self._wake.notify()  # the host thread re-queues while the engine thread may wait

    def _host_loop(self) -> None:
        while True:
            finished = self._finished.get()
            self._finished.task_done()  # the engine may start its next call now
            self._host_stage(finished)

    def _host_stage(self, finished: _Finished) -> None:
        """Supervision for each micro-batch of a finished engine call. Out of memory here (the
        self-check's logits, head decoding, host buffers: with vLLM's KV cache allocated up
        front, the likelier place) is the micro-batches' error as in the engine stage; the
        memory is freed, the engine needs no check."""
        results = self._timed(lambda: self._finish_parts(finished.engine_output, finished.parts),
                              "host_s")
        if not isinstance(results, BaseException):
            for job, result in zip(finished.jobs, results, strict=True):
                job.future.set_result(result)
        elif classify(results) is FailureKind.OUT_OF_MEMORY:
            finished.engine_output = None  # and the frames of the error, which hold tensors
            free_memory(results)
            self._out_of_memory(finished.jobs, results)
        else:
            self._fail(finished.jobs, results)

    def _finish_parts(self, engine_output: Any, parts: list[MicroBatch]
                      ) -> list[Eagle3TargetBatch]:
        return split_batch(self._run_guarded(lambda: self._finish(engine_output)), parts)

    def _settle(self, jobs: list[_Job], work: Callable[[], list[Any]], stage: str) -> None:
        """Run `work` (timed as `stage`) and give each job its result, or every job its error."""
        results = self._timed(work, stage)
        if isinstance(results, BaseException):
            self._fail(jobs, results)
            return
        for job, result in zip(jobs, results, strict=True):
            job.future.set_result(result)

    def _timed(self, work: Callable[[], Any], stage: str) -> Any:
        """`work()`'s result or the exception it raised; its seconds counted in `stage`."""
        started = time.perf_counter()
        try:
            return work()
        except BaseException as e:  # noqa: BLE001 -- every waiter gets the engine's error
            return e
        finally:
            self._count(**{stage: time.perf_counter() - started})

    def _count(self, **increments: float) -> None:
        with self._stats_lock:  # two stages update the stats
            for name, value in increments.items():
                setattr(self.stats, name, getattr(self.stats, name) + value)

    @staticmethod
    def _fail(jobs: list[_Job], error: BaseException) -> None:
        for job in jobs:
            job.future.set_exception(error)


def merge_micro_batches(parts: list[MicroBatch]) -> MicroBatch:
    """Right-pad every part to the longest and stack their rows (one part: itself); a part's
    images (a fourth element, `ImageInputs`) follow its rows."""
    if len(parts) == 1:
        return parts[0]
    seq = max(p[0].shape[1] for p in parts)
    merged = tuple(torch.cat([torch.nn.functional.pad(p[i], (0, seq - p[i].shape[1]))
                              for p in parts]) for i in range(3))
    images = ImageInputs.concat([p[3] if len(p) > 3 else None for p in parts],
                                [p[0].shape[0] for p in parts])
    return merged if images is None else (*merged, images)


def split_batch(batch: Eagle3TargetBatch, parts: list[MicroBatch]) -> list[Eagle3TargetBatch]:
    """Each part's rows and positions of a merged result (`merge_micro_batches`)."""
    if len(parts) == 1:
        return [batch]
    out, row = [], 0
    for part in parts:
        rows, seq = part[0].shape
        out.append(batch.with_tensors(**{name: t[row:row + rows, :seq]
                                         for name, t in batch.tensors().items()}))
        row += rows
    return out
