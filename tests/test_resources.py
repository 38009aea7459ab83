"""A job that can never fit the cluster says so before anything is created."""

import logging

import pytest
import ray

from eagle_ray.config import JobConfig, from_dict
from eagle_ray.resources import (
    Capacity,
    ResourcesNeverFit,
    check_job_resources,
    job_demands,
    never_fit,
)
from eagle_ray.train.job import run_job

from pool_helpers import running_ray

TWO_CPUS = Capacity(nodes=[{"CPU": 2.0, "memory": 1e9}], free={"CPU": 2.0}, node_types=[])


@ray.remote
class Hog:
    def ping(self) -> int:
        return 1


def job(**sections) -> JobConfig:
    return from_dict(JobConfig, {"target": {"cpus_per_bundle": 0.5},
                                 "train": {"cpus_per_worker": 0.5}, **sections})


def test_the_tiny_job_fits_two_cpus():
    assert never_fit(job_demands(job()), TWO_CPUS) == []


def test_a_gpu_on_a_cpu_cluster_never_fits():
    problems = never_fit(job_demands(job(train={"use_gpu": True})), TWO_CPUS)
    assert problems == ["resource 'GPU' exists nowhere in this cluster (its nodes and node types "
                        "offer ['CPU']); check train.workers / cpus_per_worker / use_gpu / "
                        "worker_resources"]


def test_a_misspelt_custom_resource_never_fits():
    cluster = Capacity([{"CPU": 8.0, "trainer_node": 8.0}], {"CPU": 8.0}, [])
    problems = never_fit(job_demands(job(train={"worker_resources": {"trainer_nod": 1}})),
                         cluster)
    assert len(problems) == 1 and "'trainer_nod' exists nowhere" in problems[0]
    assert "'trainer_node'" in problems[0], "the message lists what exists"


def test_more_workers_than_cpus_never_fit():
    problems = never_fit(job_demands(job(train={"workers": 5, "cpus_per_worker": 1.0})),
                         TWO_CPUS)
    assert problems == ["the job asks for 5.8 CPU in all (replicas, trainer workers, data "
                        "ingest) but the cluster could offer 2; lower data.cpus_per_task / "
                        "tokenize_workers or target.tp_size / cpus_per_bundle / use_gpu / "
                        "bundle_resources or train.workers / cpus_per_worker / use_gpu / "
                        "worker_resources"]


def test_a_replica_larger_than_any_node_never_fits():
    nodes = Capacity([{"CPU": 1.0, "GPU": 1.0}, {"CPU": 1.0, "GPU": 1.0}], {}, [])
    config = job(target={"tp_size": 2, "use_gpu": True, "cpus_per_bundle": 0.5},
                 train={"workers": 0})
    assert never_fit(job_demands(config), nodes) == [
        "target replica 0 needs {CPU: 1, GPU: 2} on one node, but the largest node offers "
        "{CPU: 1, GPU: 1}; change target.tp_size / cpus_per_bundle / use_gpu / bundle_resources"]


def test_node_types_an_autoscaler_can_launch_count():
    head_only = Capacity([{"CPU": 2.0}], {"CPU": 2.0}, node_types=[({"CPU": 8.0, "GPU": 8.0}, 2)])
    config = job(target={"use_gpu": True, "replicas": 4},
                 train={"workers": 8, "use_gpu": True})
    assert never_fit(job_demands(config), head_only) == []
    assert never_fit(job_demands(job(train={"workers": 17, "use_gpu": True})), head_only)


def test_a_job_joining_a_shared_pool_asks_only_for_its_workers():
    demands = job_demands(job(use_shared_pool=True))
    assert [d.what for d in demands] == ["trainer worker 0", "trainer worker 1", "data ingest"]


@pytest.fixture(scope="class")
def two_cpu_ray():
    with running_ray(num_cpus=2, object_store_mb=200, namespace="eagle_ray_test"):
        yield


@pytest.mark.slow
@pytest.mark.usefixtures("two_cpu_ray")
class TestOnARealCluster:
    @pytest.mark.parametrize(("section", "message"), [
        ({"train": {"use_gpu": True}}, "'GPU' exists nowhere"),
        ({"train": {"worker_resources": {"trainer_nod": 1}}}, "'trainer_nod' exists nowhere"),
        ({"train": {"workers": 5, "cpus_per_worker": 1.0}}, "asks for 5.8 CPU in all"),
    ])
    def test_the_job_fails_at_once_and_leaves_nothing_behind(self, tmp_path, section, message):
        config = job(output_dir=str(tmp_path), target={"name": "never", "cpus_per_bundle": 0.5,
                                                       "namespace": "eagle_ray_test"}, **section)
        with pytest.raises(ResourcesNeverFit, match=message):
            run_job(config)
        assert ray.util.placement_group_table() == {}
        assert [a for a in ray.util.list_named_actors(all_namespaces=True)] == []

    def test_busy_resources_are_waited_for_with_a_line_saying_so(self, caplog):
        hog = Hog.options(num_cpus=1.5).remote()  # another job's work holds 1.5 of 2 CPUs
        ray.get(hog.ping.remote(), timeout=60)
        with caplog.at_level(logging.WARNING, logger="eagle_ray.resources"):
            check_job_resources(job())
        assert "waiting for resources: the job needs {CPU: 1.8}, free now {CPU: 0.5}" \
            in caplog.text
        ray.kill(hog)
