"""Placement and node loss on a multi-node Ray cluster simulated on this machine.

GPUs are logical (`num_gpus` on fake nodes): placement logic is real, no GPU is touched. Replicas
run the synthetic backend; these tests are about where replicas go and what survives a node.
"""

import time

import pytest
import ray
from ray.cluster_utils import Cluster

from eagle_ray.pool import PoolClient

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TrainerStandIn,
    is_correct,
    micro_batches,
    synthetic_pool,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster():
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 2, "object_store_memory": 150 * 2**20, "include_dashboard": False,
        "resources": {"head": 100}})
    ray.init(address=cluster.address, namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def gpu_node(cluster):
    return cluster.add_node(num_cpus=2, num_gpus=2, object_store_memory=150 * 2**20)


def replica_placement(name):
    """node id of every bundle of a replica's placement group, and the group's state."""
    for info in ray.util.placement_group_table().values():
        if info["name"] == f"{name}-pg":
            return info["state"], set(info["bundles_to_node_id"].values())
    raise AssertionError(f"no placement group for {name}")


def test_replicas_pack_on_one_node_each_and_an_unfitting_one_waits(cluster):
    gpu_node(cluster)
    gpu_node(cluster)
    cluster.wait_for_nodes()
    pool = synthetic_pool("placement", replicas=3, wait=False, tp_size=2, use_gpu=True,
                          cpus_per_bundle=0.5)
    try:
        pool.wait_ready(2, timeout_s=120)
        time.sleep(2)
        status = pool.status()
        assert status["ready_replicas"] == 2
        nodes = []
        for index in range(3):
            state, bundle_nodes = replica_placement(pool.config.replica_name(index))
            if state == "CREATED":
                assert len(bundle_nodes) == 1, "a replica's TP bundles share one node"
                nodes.append(bundle_nodes.pop())
            else:
                assert state == "PENDING"
        assert len(nodes) == 2 and len(set(nodes)) == 2, "replicas sit on disjoint nodes"
        gpu_ids = [ray.get(ray.get_actor(pool.config.replica_name(i),
                                         namespace="eagle_ray_test").ready.remote())
                   for i in range(3) if replica_placement(pool.config.replica_name(i))[0]
                   == "CREATED"]
        assert all(len(info["gpu_ids"]) == 1 for info in gpu_ids)
        pending = [r for r in status["replicas"].values() if r["state"] == "starting"]
        assert len(pending) == 1, "the replica that does not fit waits; the pool serves"
        client = PoolClient.connect("placement", "eagle_ray_test")
        inputs = micro_batches(6, seed=11)
        assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
        # A node joins (as an autoscaler would add one): the pending replica comes up.
        gpu_node(cluster)
        pool.wait_ready(3, timeout_s=120)
    finally:
        pool.shutdown()


def test_removing_a_node_with_replicas_loses_no_micro_batch(cluster):
    doomed = gpu_node(cluster)
    cluster.wait_for_nodes()
    pool = synthetic_pool("node-loss", replicas=2, use_gpu=True, cpus_per_bundle=0.5,
                          backend_kwargs={"seconds_per_call": 0.05})
    try:
        # The training actors live on the head: only the target replicas' node goes away.
        trainers = [TrainerStandIn.options(resources={"head": 1}).remote("node-loss")
                    for _ in range(2)]
        runs = [t.run.remote(30, seed=30 + s) for s, t in enumerate(trainers)]
        time.sleep(1.5)
        gpu_node(cluster)  # where the replicas can be rescheduled
        cluster.remove_node(doomed)
        for result in ray.get(runs, timeout=300):
            assert len(result["correct"]) == 30 and all(result["correct"])
        pool.wait_ready(2, timeout_s=120)
        for index in range(2):
            state, bundle_nodes = replica_placement(pool.config.replica_name(index))
            assert state == "CREATED" and doomed.node_id not in bundle_nodes
    finally:
        pool.shutdown()
