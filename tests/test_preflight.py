"""`eagle-ray preflight`: a running cluster checked against a job before submitting it. Every node
answers for itself (a task pinned to it); here two nodes on one machine."""

import dataclasses

import pytest
import ray
from ray.cluster_utils import Cluster

from eagle_ray.config import JobConfig, from_dict
from eagle_ray.preflight import NodeReport, environment, node_problems, preflight
from eagle_ray.tiny import tiny_target

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1},
                      connect=False)
    cluster.add_node(num_cpus=2, resources={"trainer_gpu": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="eagle_ray_test")
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def job(tmp_path, **sections) -> JobConfig:
    return from_dict(JobConfig, {
        "target": {"model_path": str(tiny_target("llama")), "cpus_per_bundle": 0.5},
        "train": {"workers": 1, "cpus_per_worker": 0.5}, "output_dir": str(tmp_path / "run"),
        **sections})


def test_a_cluster_that_can_run_the_job_passes(two_nodes, tmp_path):
    assert preflight(job(tmp_path)) == []


def test_what_a_node_lacks_is_named_with_the_node(two_nodes, tmp_path):
    """The control: a data file no node sees, a custom resource no node has."""
    problems = preflight(job(tmp_path, data={"path": str(tmp_path / "nowhere.jsonl")},
                             train={"workers": 1, "cpus_per_worker": 0.5,
                                    "worker_resources": {"target_gpu": 1}}))
    assert any(p.startswith("resources: resource 'target_gpu' exists nowhere") for p in problems)
    unseen = [p for p in problems if "nowhere.jsonl" in p]
    assert len(unseen) == 2 and all(p.startswith("node ") for p in unseen), problems


def test_a_node_with_other_pins_or_without_the_package_installed_is_named():
    python, versions, _ = environment()
    node = NodeReport("abcdef123456", "10.0.0.7", python, {**versions, "ray": "2.59.0"},
                      plugin_entry_point=False, missing=[], not_writable=["/mnt/shared/runs"],
                      shm_bytes=64 * 2**20)
    gpu_job = from_dict(JobConfig, {"target": {"use_gpu": True}})
    problems = node_problems(node, python, versions, gpu_job)
    assert [p.split(":")[0] for p in problems] == ["node abcdef12 (10.0.0.7)"] * 4
    assert any("ray 2.59.0, the driver has " + versions["ray"] in p for p in problems)
    assert any("entry point is missing" in p for p in problems)
    assert any("cannot write /mnt/shared/runs" in p for p in problems)
    assert any("/dev/shm holds 64 MiB" in p for p in problems)
    alike = dataclasses.replace(node, versions=versions, plugin_entry_point=True,
                                not_writable=[], shm_bytes=2**34)
    assert node_problems(alike, python, versions, gpu_job) == []


def test_data_the_driver_does_not_see_is_checked_on_the_nodes_that_read_it(two_nodes, tmp_path):
    from eagle_ray.config import ConfigError
    from eagle_ray.driver import check_data_on_the_cluster

    seen = tmp_path / "chats.jsonl"
    seen.write_text("")
    check_data_on_the_cluster(job(tmp_path, data={"path": str(seen)}))
    with pytest.raises(ConfigError, match=r"does not exist on node .* node "):
        check_data_on_the_cluster(job(tmp_path, data={"path": str(tmp_path / "gone.jsonl")}))
