"""The pool and Ray's autoscaler together, on Ray's fake multi-node provider: replicas the pool
adds are placement groups the autoscaler launches (fake) GPU nodes for, and nodes freed by a
scale-down are reaped. Training stand-ins on the head stream throughout, exactly once.

The head is started with `ray start --autoscaling-config` (autoscaler v1, `RAY_FAKE_CLUSTER=1`;
`ray.cluster_utils.AutoscalingCluster` cannot be used as shipped in the 2.60 wheel and would
`ray stop --force` every Ray on the machine), on free ports, and only its processes are stopped.
"""

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
import yaml

from eagle_ray.config.pool import AutoscalingConfig

from pool_helpers import (
    TESTS_ON_WORKER_PATH,
    TIMEOUT_S,
    TrainerStandIn,
    synthetic_pool,
    wait_until,
)
from ray_heads import BIN, agent_port_args, free_port, short_temp_dir, stop_head

pytestmark = pytest.mark.slow

STORE = 150 * 2**20
# Ray's fake multi-node provider: worker nodes are processes on this machine, launched and
# terminated by the autoscaler like cloud instances.
FAKE_CLUSTER = {
    "cluster_name": "eagle-ray-fake", "max_workers": 2, "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True,
                 "disable_node_updaters": True, "disable_launch_config_check": True},
    "available_node_types": {
        "ray.head.default": {"resources": {"CPU": 2, "head": 100}, "node_config": {},
                             "max_workers": 0},
        "gpu_node": {"resources": {"CPU": 2, "GPU": 1, "object_store_memory": STORE},
                     "node_config": {}, "min_workers": 0, "max_workers": 2},
    },
    "head_node_type": "ray.head.default", "auth": {}, "docker": {},
    "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
    "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
    "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
    "rsync_exclude": [], "rsync_filter": [],
}


@pytest.fixture(scope="module")
def autoscaling_head(tmp_path_factory):
    """The GCS address of a fake autoscaling head, stopped (with its nodes) afterwards."""
    temp_dir, port = short_temp_dir(), free_port()
    gcs = f"{ray.util.get_node_ip_address()}:{port}"
    config = {**FAKE_CLUSTER, "provider": {**FAKE_CLUSTER["provider"], "gcs_address": gcs}}
    config_path = tmp_path_factory.mktemp("fake-cluster") / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
           "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1",
           "RAY_AUTH_MODE": "disabled"}  # not what this test is about (test_job_submit is)
    env.pop("RAY_ADDRESS", None)
    subprocess.run([BIN / "ray", "start", "--head", f"--port={port}", "--num-cpus=2",
                    f"--resources={json.dumps({'head': 100})}", f"--object-store-memory={STORE}",
                    f"--autoscaling-config={config_path}", f"--temp-dir={temp_dir}",
                    "--include-dashboard=false", f"--ray-client-server-port={free_port()}",
                    *agent_port_args(), "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=120)
    try:
        yield gcs
    finally:
        stop_head(temp_dir, f":{port}")


def test_the_autoscaler_brings_nodes_for_new_replicas_and_reaps_them(autoscaling_head,
                                                                       tmp_path):
    # A fresh driver process: one that already ran a local Ray instance (earlier test modules)
    # does not reliably create actors on a cluster started by `ray start`.
    result = subprocess.run(
        [sys.executable, "-c", f"import {Path(__file__).stem} as t; "
                               f"t.scenario({autoscaling_head!r}, {str(tmp_path)!r})"],
        cwd=Path(__file__).parent, capture_output=True, text=True, timeout=TIMEOUT_S,
        env={**os.environ, "RAY_AUTH_MODE": "disabled",
             "PYTHONPATH": TESTS_ON_WORKER_PATH["env_vars"]["PYTHONPATH"]})
    assert result.returncode == 0, result.stderr[-6000:]
    assert "scenario passed" in result.stdout


def gpu_nodes() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU")]


def scenario(gcs: str, tmp_path: str) -> None:
    """The test itself, in the driver process it owns."""
    ray.init(address=gcs, namespace="eagle_ray_test", runtime_env=TESTS_ON_WORKER_PATH)
    assert gpu_nodes() == [], "the cluster starts without GPU nodes"
    gate = Path(tmp_path) / "hold"
    # The first replica's placement group asks for a GPU: the autoscaler launches a node.
    pool = synthetic_pool(
        "nodes", replicas=1, use_gpu=True, cpus_per_bundle=0.5, router_resources={"head": 1},
        backend_kwargs={"hold_while": str(gate)}, ready_timeout_s=120,
        autoscaling=AutoscalingConfig(min_replicas=1, max_replicas=2,
                                      target_outstanding_tokens_per_replica=100,
                                      upscale_delay_s=0.5, downscale_delay_s=1.0,
                                      interval_s=0.2))
    try:
        assert len(gpu_nodes()) == 1
        gate.touch()
        # lease_reuse_s 0: every micro-batch asks the router, so the added replica gets work
        # at once (passed-on leases would reach it only when they expire).
        trainers = [TrainerStandIn.options(resources={"head": 1}).remote("nodes", lease_reuse_s=0)
                    for _ in range(2)]
        runs = [t.run.remote(30, seed=100 + s) for s, t in enumerate(trainers)]
        # Demand above target: a second replica, pending until the autoscaler adds its node.
        wait_until(lambda: pool.status()["ready_replicas"] == 2, timeout_s=120,
                   what="a second replica ready on a new node")
        nodes = {r["node_id"] for r in pool.status()["replicas"].values()}
        assert len(nodes) == 2 and nodes == set(gpu_nodes())
        gate.unlink()
        served = collections.Counter()
        for result in ray.get(runs, timeout=TIMEOUT_S):
            assert len(result["correct"]) == 30 and all(result["correct"])
            assert result["stats"].delivered == 30
            served.update(result["stats"].served_by)
        assert len(served) == 2 and sum(served.values()) == 60, "both served, each batch once"
        # Demand gone: one replica is drained and removed, and its node reaped when idle.
        wait_until(lambda: len(pool.status()["replicas"]) == 1, what="scaled down")
        wait_until(lambda: len(gpu_nodes()) == 1, timeout_s=120, what="the idle node reaped")
        assert pool.status()["ready_replicas"] == 1
    finally:
        pool.shutdown()
        ray.shutdown()
    print("scenario passed")
