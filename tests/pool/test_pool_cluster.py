"""Placement and node loss on a multi-node Ray cluster simulated on this machine.

GPUs are logical (`num_gpus` on fake nodes): placement logic is real, no GPU is touched. Replicas
run the synthetic backend; these tests are about where replicas go and what survives a node.
"""

import collections
import logging
import threading
import time

import pytest
import ray
from ray.cluster_utils import Cluster
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from eagle_ray.pool import PoolClient

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    TrainerStandIn,
    engine_inside,
    is_correct,
    micro_batches,
    retries,
    synthetic_pool,
    wait_until,
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
        time.sleep(2)  # not a race: the third replica cannot fit; this gives a bug time to show
        status = pool.status()
        assert status["ready_replicas"] == 2
        nodes = []
        for index in range(3):
            state, bundle_nodes = replica_placement(pool.config.replica_name(index))
            if state == "CREATED":
                assert len(bundle_nodes) == 1, "a replica's TP ranks share one node"
                nodes.append(bundle_nodes.pop())
            else:
                assert state == "PENDING"
        assert len(nodes) == 2 and len(set(nodes)) == 2, "replicas sit on disjoint nodes"
        gpu_ids = [ray.get(ray.get_actor(pool.config.replica_name(i),
                                         namespace="eagle_ray_test").ready.remote(),
                           timeout=TIMEOUT_S)
                   for i in range(3) if replica_placement(pool.config.replica_name(i))[0]
                   == "CREATED"]
        assert all(len(info.gpu_ids) == 2 for info in gpu_ids), "the replica holds its TP GPUs"
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


def test_removing_a_node_with_replicas_loses_no_micro_batch(cluster, tmp_path):
    doomed = gpu_node(cluster)
    cluster.wait_for_nodes()
    gate = tmp_path / "hold"
    gate.touch()
    pool = synthetic_pool("node-loss", replicas=2, use_gpu=True, cpus_per_bundle=0.5,
                          backend_kwargs={"hold_while": str(gate)})
    try:
        # The training actors live on the head: only the target replicas' node goes away.
        trainers = [TrainerStandIn.options(resources={"head": 1}).remote("node-loss")
                    for _ in range(2)]
        runs = [t.run.remote(60, seed=30 + s) for s, t in enumerate(trainers)]
        # Calls are held on both doomed replicas when their node goes.
        wait_until(lambda: all(engine_inside(pool, i) >= 1 for i in range(2)),
                   what="micro-batches on both replicas")
        gpu_node(cluster)  # where the replicas can be rescheduled
        cluster.remove_node(doomed)
        # The gate opens only once the clients have seen the loss: a replica's worker may
        # outlive its raylet for a moment, and a held call let go then could still answer.
        wait_until(lambda: retries(trainers) >= 2, what="the held calls re-run")
        gate.unlink()
        results = ray.get(runs, timeout=TIMEOUT_S)
        for result in results:
            assert len(result["correct"]) == 60 and all(result["correct"])
        assert sum(r["stats"].retries for r in results) >= 2, "calls in flight were re-run"
        pool.wait_ready(2, timeout_s=120)
        for index in range(2):
            state, bundle_nodes = replica_placement(pool.config.replica_name(index))
            assert state == "CREATED" and doomed.node_id not in bundle_nodes
    finally:
        pool.shutdown()


def router_home(cluster):
    """A node only the router may use (resource `router_home`): removing it takes the router
    down until a node with that resource joins, a restart whose length the test decides."""
    return cluster.add_node(num_cpus=0, resources={"router_home": 1},
                            object_store_memory=150 * 2**20)


def test_a_client_connects_while_the_router_restarts(cluster, caplog):
    home = router_home(cluster)
    cluster.wait_for_nodes()
    pool = synthetic_pool("connect", replicas=1, router_resources={"router_home": 0.01})
    try:
        cluster.remove_node(home)
        connected = {}
        connecting = threading.Thread(target=lambda: connected.update(
            client=PoolClient.connect("connect", "eagle_ray_test")))
        with caplog.at_level(logging.WARNING, logger="eagle_ray.pool.client"):
            connecting.start()
            wait_until(lambda: "unavailable" in caplog.text, what="connect meeting the outage")
        assert connecting.is_alive(), "connect waits for the router instead of failing"
        router_home(cluster)
        connecting.join(TIMEOUT_S)
        client = connected["client"]
        assert client.stats.router_retries >= 1
        inputs = micro_batches(4, seed=40)
        assert all(is_correct(x, b) for x, b in zip(inputs, client.stream(inputs), strict=True))
    finally:
        pool.shutdown()


@pytest.mark.parametrize("reuse", ["fresh-leases", "default-reuse"])
def test_a_router_outage_mid_stream_loses_no_result_and_clients_recover(cluster, tmp_path,
                                                                         reuse):
    home = router_home(cluster)
    cluster.wait_for_nodes()
    gate = tmp_path / "hold"
    gate.touch()
    name = f"router-outage-{reuse}"
    pool = synthetic_pool(name, router_resources={"router_home": 0.01},
                          backend_kwargs={"hold_while": str(gate)})
    try:
        # fresh-leases (lease_reuse_s 0): every micro-batch after the window needs the router.
        # default-reuse (5 s): leases pass on, so the replicas hold the windows until every
        # lease is past its term; then the next micro-batches need the router as well.
        reuse_s = {"lease_reuse_s": 0} if reuse == "fresh-leases" else {}
        trainers = [TrainerStandIn.options(resources={"head": 1}).remote(
            name, max_inflight_micro_batches=4, **reuse_s) for _ in range(2)]
        runs = [t.run.remote(20, seed=50 + s) for s, t in enumerate(trainers)]
        # Both windows are leased and held on the replicas; the rest needs the router.
        wait_until(lambda: sum(r["outstanding_micro_batches"]
                               for r in pool.status()["replicas"].values()) == 8,
                   what="both clients' windows leased")
        cluster.remove_node(home)
        wait_until(lambda: all(ray.get([t.leases_expired.remote() for t in trainers],
                                       timeout=TIMEOUT_S)), what="every held lease expired")
        gate.unlink()
        wait_until(lambda: all(ray.get(t.stats.remote(), timeout=TIMEOUT_S).router_retries
                               >= 1 for t in trainers), what="both clients retrying the router")
        router_home(cluster)
        for result in ray.get(runs, timeout=TIMEOUT_S):
            assert len(result["correct"]) == 20 and all(result["correct"])
            assert result["stats"].delivered == 20 and result["stats"].router_retries >= 1
        pool.wait_ready(2, timeout_s=120)  # the restarted router re-adopted both replicas
    finally:
        pool.shutdown()


def plan_node(cluster):
    """A node laid out as the placement plan lays out a GPU node (docs/architecture.md,
    "Locality"): room for one target replica and one trainer."""
    return cluster.add_node(num_cpus=2, resources={"target_slot": 1, "trainer_slot": 1},
                            object_store_memory=150 * 2**20)


def served_by(trainer) -> collections.Counter:
    """Results the trainer's client received, per replica (counted as they arrive; the router's
    own counts are updated by releases that may still be on their way)."""
    return ray.get(trainer.stats.remote(), timeout=TIMEOUT_S).served_by


@pytest.mark.parametrize("locality", [True, False], ids=["locality", "control-no-locality"])
def test_every_one_of_twenty_leases_goes_to_the_trainers_node_and_without_locality_none(
        cluster, locality):
    """On-node share over 20 leases (no lease reuse: one lease per micro-batch). The trainer
    sits on the node of the replica that ties never pick (the policy breaks ties by the lowest
    name), so with locality off -- the control -- every lease goes off its node."""
    plan_node(cluster)
    plan_node(cluster)
    cluster.wait_for_nodes()
    name = f"share-{'on' if locality else 'off'}"
    pool = synthetic_pool(name, bundle_resources={"target_slot": 1}, locality=locality)
    try:
        replicas = pool.status()["replicas"]
        passed_over = replicas[max(replicas)]["node_id"]
        trainer = TrainerStandIn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(
            passed_over, soft=False)).remote(name, max_inflight_micro_batches=1, lease_reuse_s=0)
        result = ray.get(trainer.run.remote(20, seed=90), timeout=TIMEOUT_S)
        assert len(result["correct"]) == 20 and all(result["correct"])
        status = pool.status()
        assert status["leases"] == 20, "one lease per micro-batch"
        assert status["on_node_share"] == (1.0 if locality else 0.0), status["on_node_share"]
    finally:
        pool.shutdown()


def test_trainers_are_served_on_their_node_and_elsewhere_only_while_its_replica_is_down(
        cluster, tmp_path):
    plan_node(cluster)
    plan_node(cluster)
    cluster.wait_for_nodes()
    hold_calls, hold_restart = tmp_path / "hold-calls", tmp_path / "hold-restart"
    pool = synthetic_pool("locality", bundle_resources={"target_slot": 1}, backend_kwargs={
        "hold_while": str(hold_calls), "hold_restart_while": str(hold_restart)})
    try:
        # One micro-batch in flight per trainer, so the moment of the kill below is exact.
        trainers = [TrainerStandIn.options(resources={"trainer_slot": 1}).remote(
            "locality", max_inflight_micro_batches=1) for _ in range(2)]
        for result in ray.get([t.run.remote(10, seed=60 + s) for s, t in enumerate(trainers)],
                              timeout=TIMEOUT_S):
            assert len(result["correct"]) == 10 and all(result["correct"])
        status = pool.status()
        assert len({r["node_id"] for r in status["replicas"].values()}) == 2, "one per node"
        # Leases are counted when granted, before the call: these counts are complete.
        assert status["on_node_share"] == 1.0, "every lease went to the trainer's own node"
        assert all(r["on_node_share"] == 1.0 for r in status["replicas"].values())
        node = ray.get(trainers[0].node_id.remote(), timeout=TIMEOUT_S)
        own = next(n for n, r in status["replicas"].items() if r["node_id"] == node)
        other = next(n for n in status["replicas"] if n != own)
        assert served_by(trainers[0]) == {own: 10} and served_by(trainers[1]) == {other: 10}

        # The trainer's own replica dies with its micro-batch on the engine, and Ray's restart
        # of it is held: everything goes to the other node's replica meanwhile.
        hold_calls.touch()
        hold_restart.touch()
        before = served_by(trainers[0])
        run = trainers[0].run.remote(12, seed=70)
        wait_until(lambda: (tmp_path / "hold-calls.holding").exists(), what="a call on the engine")
        ray.kill(ray.get_actor(own, namespace="eagle_ray_test"), no_restart=False)
        # The gate opens only once the kill has landed (the client re-ran the held attempt);
        # opened before, the held call could finish first.
        wait_until(lambda: retries(trainers[:1]) == 1,
                   what="the held attempt lost with the replica and re-run")
        hold_calls.unlink()
        result = ray.get(run, timeout=TIMEOUT_S)
        assert len(result["correct"]) == 12 and all(result["correct"])
        assert result["stats"].retries == 1, "the killed attempt was re-run, nothing else"
        assert result["stats"].served_by - before == {other: 12}, "all elsewhere at once"

        # Back when it returns: the trainer's micro-batches stay on its node again.
        hold_restart.unlink()
        wait_until(lambda: replica_state(pool, own) == ("ready", 1), timeout_s=120,
                   what="the restarted replica ready again")
        before = served_by(trainers[0])
        result = ray.get(trainers[0].run.remote(10, seed=80), timeout=TIMEOUT_S)
        assert all(result["correct"])
        assert result["stats"].served_by - before == {own: 10}

        # It dies again, idle this time (no call of a client fails on it): its health probe
        # goes unanswered while the restart is held, the router stops leasing it, and the
        # trainer is served elsewhere instead of waiting for the restart.
        hold_restart.touch()
        ray.kill(ray.get_actor(own, namespace="eagle_ray_test"), no_restart=False)
        wait_until(lambda: replica_state(pool, own)[0] == "suspect", timeout_s=120,
                   what="the idle dead replica suspect")
        stats = ray.get(trainers[0].stats.remote(), timeout=TIMEOUT_S)
        result = ray.get(trainers[0].run.remote(10, seed=81), timeout=TIMEOUT_S)
        assert all(result["correct"]) and result["stats"].retries == stats.retries
        assert result["stats"].served_by - stats.served_by == {other: 10}
        hold_restart.unlink()
    finally:
        pool.shutdown()


def replica_state(pool, name: str) -> tuple[str, int]:
    replica = pool.status()["replicas"].get(name, {"state": "absent", "restarts": 0})
    return replica["state"], replica["restarts"]
