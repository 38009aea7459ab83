"""A light replica for `eagle-ray bench scale`: an actor that answers the replica's calls
(`ready`, `generate_many`) with a GPU engine's timing and tiny payloads, and nothing else.

The scale benchmark is about the control plane (router, controller, clients) at 64 replicas on
one small machine. A real replica imports torch and builds an engine: about 165 MiB of private
memory per process before any engine, and seconds of start-up each. This one imports Ray, numpy
and the pool's protocol records only (about 40 MiB private), so 64 fit beside 512 trainers.
Each is its own actor, so the router, the controller and the clients see 64 separate replicas:
one process per replica (a Ray actor is a process; several replicas in one process would share a
name, a handle and a queue, which is not what the router is measured against).

The engine stand-in merges what waits, up to `max_tokens_per_engine_call` padded slots a call,
and sleeps `engine_seconds_per_token` per slot (an H100 serving an 8B target: a 16,384-token
call in about 0.4 s, ~40k tokens/s), one call at a time, as `EngineQueue` does. Its answers
are valid supervision of hidden size 1 (`pool.transport`'s payload layout), so clients decode
them as they would a real replica's.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import ray

from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool.protocol import EngineStats, ReplicaInfo

CLASS = "eagle_ray.bench.light_replica:LightReplica"  # `PoolConfig.replica_class`
VOCAB_SIZE = 1024
MAX_LENGTH = 8192
H100_SECONDS_PER_TOKEN = 0.4 / 16384  # an 8B target's forward on one H100, ~40k tokens/s
LAYERS_KEY = "num_aux_layers"  # `pool.transport.LAYERS_KEY` (that module imports torch)


def payload(input_ids: np.ndarray, attention_mask: np.ndarray, loss_mask: np.ndarray
            ) -> dict[str, tuple]:
    """Supervision for one micro-batch as `pool.transport.batch_to_numpy` lays it out: three aux
    layers and the last hidden state, each one value wide (zeros), and the inputs."""
    rows, seq = input_ids.shape
    return {"aux_hidden_states": (np.zeros((rows, seq, 3), np.float16), "float16"),
            "input_ids": (input_ids, str(input_ids.dtype)),
            "attention_mask": (attention_mask, _dtype_name(attention_mask)),
            "loss_mask": (loss_mask, _dtype_name(loss_mask)),
            "last_hidden": (np.zeros((rows, seq, 1), np.float16), "float16"),
            LAYERS_KEY: (3,)}


def _dtype_name(array: np.ndarray) -> str:
    return "bool" if array.dtype == np.bool_ else str(array.dtype)


class LightReplica:
    """Ray actor standing in for `TargetReplica` (`PoolConfig.replica_class`); see the module
    docstring. `backend_kwargs`: `engine_seconds_per_token` (default: an H100's)."""

    def __init__(self, config: PoolConfig, index: int) -> None:
        self.index = index
        self.seconds_per_token = config.backend_kwargs.get("engine_seconds_per_token",
                                                           H100_SECONDS_PER_TOKEN)
        self.max_tokens = config.max_tokens_per_engine_call
        self.stats = EngineStats()
        self.served_tokens = self.served_micro_batches = 0
        self._waiting: collections.deque[tuple[int, Future]] = collections.deque()
        self._wake = threading.Condition()
        threading.Thread(target=self._engine_loop, daemon=True, name="engine").start()

    @ray.method(concurrency_group="health")
    def ready(self) -> ReplicaInfo:
        """Where it runs and what its target accepts (the router's probe)."""
        return ReplicaInfo(index=self.index, node_id=ray.get_runtime_context().get_node_id(),
                           pid=os.getpid(), vocab_size=VOCAB_SIZE, max_length=MAX_LENGTH,
                           aux_layer_ids=[1, 3, 4], served_tokens=self.served_tokens,
                           served_micro_batches=self.served_micro_batches, engine=self.stats,
                           max_tokens_per_engine_call=self.max_tokens)

    @ray.method(concurrency_group="generate")
    def generate_many(self, micro_batch_ids: list[int], *inputs: Any) -> list[dict[str, tuple]]:
        """Each micro-batch's supervision once the engine stand-in has run it (merged with
        whatever else waits)."""
        futures = []
        with self._wake:
            for arrays in inputs:
                futures.append(Future())
                self._waiting.append((int(arrays[0].size), futures[-1]))
            self._wake.notify()
        for future in futures:
            future.result()
        self.served_micro_batches += len(inputs)
        self.served_tokens += sum(int(arrays[1].sum()) for arrays in inputs)
        return [payload(*arrays[:3]) for arrays in inputs]

    def _engine_loop(self) -> None:
        """One engine call at a time: what waits, up to `max_tokens` padded slots (a larger
        micro-batch alone), for its slots' time."""
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                call = [self._waiting.popleft()]
                slots = call[0][0]
                while self._waiting and slots + self._waiting[0][0] <= self.max_tokens:
                    call.append(self._waiting.popleft())
                    slots += call[-1][0]
            started = time.perf_counter()
            time.sleep(slots * self.seconds_per_token)
            self.stats.engine_calls += 1
            self.stats.micro_batches += len(call)
            self.stats.merged_calls += len(call) > 1
            self.stats.engine_s += time.perf_counter() - started
            for _, future in call:
                future.set_result(None)
