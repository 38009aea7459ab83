"""Result transport: a replica's supervision reaching its client, on the same node and across
nodes, against a memcpy of the same bytes.

Two Ray nodes on this machine (`ray.cluster_utils.Cluster`): separate raylets and object stores,
so an object produced on the other node is pulled by Ray's object manager as it would be between
machines (over loopback here; a real network is faster, the gap to shared memory remains).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import ray
import torch
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eagle_ray.bench import NAMESPACE, best_seconds, emit
from eagle_ray.contract.target_batch import Eagle3TargetBatch
from eagle_ray.pool.transport import batch_from_numpy, batch_to_numpy, payload_arrays


@contextlib.contextmanager
def simulated_nodes(count: int, object_store_mb: int, **node_args) -> Iterator[list]:
    """Connect this process to a head plus `count` worker nodes started on this machine; yields
    the worker nodes (`.node_id`). The head (this process's node) takes no work."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": object_store_mb * 2**20,
        "include_dashboard": False})
    nodes = [cluster.add_node(object_store_memory=object_store_mb * 2**20, **node_args)
             for _ in range(count)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        yield nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id, soft=False)


@ray.remote(num_cpus=0)
class _TransportSource:
    """Holds one supervision batch and returns it the way a replica does."""

    def __init__(self, tokens: int, hidden: int) -> None:
        aux = torch.randn(1, tokens, 3 * hidden).to(torch.bfloat16)
        ids = torch.ones(1, tokens, dtype=torch.long)
        self.batch = Eagle3TargetBatch(aux, ids, ids, ids,
                                       last_hidden=torch.randn(1, tokens, hidden).bfloat16())

    def fetch(self) -> dict:
        return batch_to_numpy(self.batch)


def run(tokens: int = 8192, hidden: int = 4096, repeats: int = 5) -> None:
    """Bytes/s from a replica-like actor to this process, from this node and from the other one,
    against a copy of the same bytes into a warm (already faulted-in) buffer. Per path two
    figures: `mapped` (the result as the training loop gets it: on the same node zero-copy views,
    not yet touched; from another node pulled into this node's store first) and `mapped_and_read`
    (every byte then read, by copying it into a warm buffer as a consumer would)."""
    with simulated_nodes(1, object_store_mb=1536, num_cpus=1) as (other,):
        here = ray.get_runtime_context().get_node_id()
        sources = {where: _TransportSource.options(scheduling_strategy=on_node(node)).remote(
            tokens, hidden) for where, node in (("same_node", here), ("cross_node", other.node_id))}
        local = ray.get(sources["same_node"].fetch.remote())
        arrays = payload_arrays(local)
        nbytes = sum(a.nbytes for a in arrays)
        warm = [np.empty_like(a) for a in arrays]
        del local

        def copy_into_warm(source_arrays) -> None:
            for buffer, array in zip(warm, source_arrays, strict=True):
                np.copyto(buffer, array)

        def mapped(source) -> None:
            batch_from_numpy(ray.get(source.fetch.remote()))

        def mapped_and_read(source) -> None:
            payload = ray.get(source.fetch.remote())
            batch_from_numpy(payload)
            copy_into_warm(payload_arrays(payload))

        copy_s = best_seconds(lambda: copy_into_warm(arrays), repeats)
        emit("transport", "bytes_per_s", round(nbytes / copy_s), "B/s", path="memcpy_warm",
             mb=round(nbytes / 2**20, 1), baseline="memcpy_warm", ratio=1.0)
        for where, source in sources.items():
            for how, fn in (("mapped", mapped), ("mapped_and_read", mapped_and_read)):
                seconds = best_seconds(lambda fn=fn, source=source: fn(source), repeats)
                emit("transport", "bytes_per_s", round(nbytes / seconds), "B/s",
                     path=f"object_store_{how}", where=where, mb=round(nbytes / 2**20, 1),
                     baseline="memcpy_warm", ratio=round(copy_s / seconds, 3))
