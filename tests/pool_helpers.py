"""Helpers shared by the pool tests: a synthetic-backend pool and a training-actor stand-in."""

from __future__ import annotations

import contextlib
import copy
import os
import time
from pathlib import Path

import ray
import torch

from eagle_ray.pool import ClientConfig, PoolClient, PoolConfig, TargetPool
from eagle_ray.pool.protocol import ClientStats
from eagle_ray.pool.states import MicroBatchPhase
from eagle_ray.testing import random_micro_batch, synthetic_aux_states

SYNTHETIC = "eagle_ray.testing:fixed_latency_target"
# Ray workers import this module (TrainerStandIn lives here) and test modules: put tests/ and
# its folders on their path.
TESTS_PATH = os.pathsep.join(str(folder) for folder in [
    Path(__file__).parent, *sorted(p for p in Path(__file__).parent.iterdir()
                                   if p.is_dir() and p.name.isidentifier())])
# The driver's own PYTHONPATH too: a run from another checkout must not load this one's package.
TESTS_ON_WORKER_PATH = {"env_vars": {"PYTHONPATH": os.pathsep.join(
    [TESTS_PATH, *filter(None, [os.environ.get("PYTHONPATH")])])}}
HIDDEN = 8
VOCAB = 1024


@contextlib.contextmanager
def running_ray(num_cpus: int = 4, object_store_mb: int = 300, **kwargs):
    """A local Ray instance for one test module, shut down afterwards."""
    ray.init(num_cpus=num_cpus, object_store_memory=object_store_mb * 2**20,
             include_dashboard=False, **kwargs)
    try:
        yield
    finally:
        ray.shutdown()


def synthetic_pool(name: str, replicas: int = 2, wait: bool = True, backend_kwargs=None,
                   **config) -> TargetPool:
    config.setdefault("cpus_per_bundle", 0.25)
    return TargetPool.create(PoolConfig(
        backend=SYNTHETIC, name=name, namespace="eagle_ray_test", replicas=replicas,
        backend_kwargs={"hidden_size": HIDDEN, "vocab_size": VOCAB, **(backend_kwargs or {})},
        **config), wait=wait)


def micro_batches(count: int, seed: int):
    """Deterministic micro-batches; ids start at 1 so token 0 can trigger failures on purpose."""
    return [random_micro_batch(VOCAB, (12, 5, 9), seed=seed * 10_000 + i) for i in range(count)]


def is_correct(inputs, batch, hidden: int = HIDDEN) -> bool:
    """Does `batch` carry the synthetic supervision of exactly these inputs?"""
    ids, attention, _ = inputs
    expected = synthetic_aux_states(ids, hidden) * attention.unsqueeze(-1)
    return bool(torch.equal(batch.aux_hidden_states, expected))


def results_or_errors(client: PoolClient, micro_batch_ids: list[int],
                      expected: type[BaseException] | tuple[type[BaseException], ...]) -> list:
    """Each submitted micro-batch's result in turn, or the `expected` error raised for it."""
    answers = []
    for micro_batch_id in micro_batch_ids:
        try:
            answers.append(client.result(micro_batch_id))
        except expected as e:
            answers.append(e)
    return answers


# Every wait on Ray in the tests is bounded, so a regression fails instead of hanging CI.
TIMEOUT_S = 300


@ray.remote(num_cpus=0, max_concurrency=2)
class TrainerStandIn:
    """A draft-training actor's use of the pool: stream micro-batches, check each result.
    `stats()` answers while `run()` streams (two threads)."""

    def __init__(self, pool_name: str, **client_config) -> None:
        self.client = PoolClient.connect(pool_name, "eagle_ray_test",
                                         ClientConfig(**client_config))

    def run(self, count: int, seed: int) -> dict:
        inputs = micro_batches(count, seed)
        correct = [is_correct(x, b) for x, b in zip(inputs, self.client.stream(inputs),
                                                    strict=True)]
        return {"correct": correct, "stats": copy.deepcopy(self.client.stats)}

    def stats(self) -> ClientStats:
        return copy.deepcopy(self.client.stats)

    def leases_expired(self) -> bool:
        """Whether the client holds leases and every one is past its reuse term (so the next
        micro-batch needs the router). Read while `run()` waits on held replicas."""
        now = time.monotonic()
        held = [i.lease for i in list(self.client._inflight.values()) if i.lease is not None]
        held += list(self.client._router._spares)
        return bool(held) and all(lease.expires <= now for lease in held)

    def running(self) -> int:
        """Micro-batches the client has on replicas now (read while `run()` waits on them)."""
        while True:
            try:
                return sum(i.phase is MicroBatchPhase.RUNNING
                           for i in list(self.client._inflight.values()))
            except RuntimeError:  # `run()` changed the window meanwhile: read it again
                continue

    def node_id(self) -> str:
        return self.client.node_id

    def pid(self) -> int:
        return os.getpid()


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached in {timeout_s:.0f}s"
        time.sleep(0.1)


def replica_handle(pool: TargetPool, index: int):
    return ray.get_actor(pool.config.replica_name(index), namespace=pool.config.namespace)


def replica_status(pool: TargetPool, index: int) -> dict:
    return pool.status()["replicas"][pool.config.replica_name(index)]


def engine_inside(pool: TargetPool, index: int) -> int:
    """Micro-batches waiting for or on replica `index`'s engine now (the replica's own count)."""
    return ray.get(replica_handle(pool, index).ready.remote(),
                   timeout=TIMEOUT_S).engine.inside


def retries(trainers) -> int:
    """Attempts the trainers' clients re-ran so far (counted when each is lost, before the
    re-run's result)."""
    return sum(stats.retries for stats in ray.get([t.stats.remote() for t in trainers],
                                                     timeout=TIMEOUT_S))


def replica_indices(config: PoolConfig) -> list[int]:
    """Indices of the pool's replica actors alive on the cluster: what a test looks for after a
    shutdown (the pool itself never lists the cluster; its controller knows its replicas)."""
    return sorted(int(actor["name"][len(config.replica_prefix):])
                  for actor in ray.util.list_named_actors(all_namespaces=True)
                  if actor["namespace"] == config.namespace
                  and actor["name"].startswith(config.replica_prefix))


def placement_groups(config: PoolConfig) -> list[str]:
    """Names of the pool's placement groups on the cluster not yet removed."""
    return [info["name"] for info in ray.util.placement_group_table().values()
            if info["name"].startswith(config.replica_prefix) and info["state"] != "REMOVED"]
