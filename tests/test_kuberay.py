"""The KubeRay manifests (examples/kuberay) validate against KubeRay's own CRD schemas, kept in
the repository (trimmed of Kubernetes core types by scripts/trim_kuberay_crds.py), strictly:
an unknown field is an error, as with `kubectl apply --validate=strict`."""

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml

from eagle_ray.config import JobConfig, load_yaml

ROOT = Path(__file__).resolve().parent.parent
KUBERAY = ROOT / "examples" / "kuberay"


def strict(schema: dict) -> dict:
    """Unknown fields are errors wherever the schema lists the fields."""
    schema = copy.deepcopy(schema)
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for key, value in schema.items():
        if key == "properties":
            schema[key] = {k: strict(v) for k, v in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            schema[key] = strict(value)
    return schema


def validate(manifest: dict) -> None:
    kind = manifest["kind"].lower()
    crd = json.loads(next((KUBERAY / "schemas").glob(f"{kind}-v*.json")).read_text())
    assert manifest["apiVersion"] == f"{crd['group']}/v1" and manifest["kind"] == crd["kind"]
    jsonschema.validate(manifest, strict(crd["schema"]))


def manifest(name: str) -> dict:
    return yaml.safe_load((KUBERAY / name).read_text())


@pytest.mark.parametrize("name", ["raycluster.yaml", "rayjob.yaml"])
def test_the_manifests_validate_against_the_kuberay_crds(name):
    validate(manifest(name))


def test_a_misspelt_field_is_refused():
    cluster = manifest("raycluster.yaml")
    cluster["spec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        validate(cluster)
    cluster = manifest("raycluster.yaml")
    cluster["spec"]["enableInTreeAutoscaling"] = "yes"
    with pytest.raises(jsonschema.ValidationError, match="boolean"):
        validate(cluster)


def test_the_rayjob_runs_the_readmes_training_command_on_the_cluster():
    job, cluster = manifest("rayjob.yaml"), manifest("raycluster.yaml")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    entrypoint = job["spec"]["entrypoint"]
    assert entrypoint in (ROOT / "docs/training.md").read_text()
    assert entrypoint.startswith("eagle-ray train --config ")
    load_yaml(JobConfig, ROOT / entrypoint.split()[-1])


def test_the_worker_group_follows_the_placement_plan_of_cluster_yaml():
    cluster = manifest("raycluster.yaml")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    group = cluster["spec"]["workerGroupSpecs"][0]
    plan = yaml.safe_load((ROOT / "cluster.yaml").read_text())["available_node_types"][
        "gpu_colocated"]
    assert {k: float(v) for k, v in group["resources"].items()} == {
        k: v for k, v in plan["resources"].items() if k not in ("CPU", "GPU")}
    gpus = group["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]
    assert int(gpus) == plan["resources"]["GPU"]
    assert (group["minReplicas"], group["maxReplicas"]) == (0, plan["max_workers"])


def pod_templates(cluster: dict) -> dict[str, dict]:
    """Every pod template of a RayCluster by group ("head" and each worker group)."""
    templates = {"head": cluster["spec"]["headGroupSpec"]["template"]}
    templates.update({g["groupName"]: g["template"] for g in cluster["spec"]["workerGroupSpecs"]})
    return templates


def mount_problems(cluster: dict, claim: str, path: str) -> list[str]:
    """Pods that could run the driver (the head) or a worker and do not mount `claim` at `path`."""
    problems = []
    for group, template in pod_templates(cluster).items():
        volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
        mounted = [m for c in template["spec"]["containers"] for m in c.get("volumeMounts", [])
                   if m["mountPath"] == path]
        if not any(volumes.get(m["name"], {}).get("persistentVolumeClaim", {}).get("claimName")
                   == claim for m in mounted):
            problems.append(f"{group} does not mount {claim} at {path}")
    return problems


def test_every_pod_that_runs_the_driver_or_a_worker_mounts_the_recipes_storage():
    """The RayJob's driver runs on the head, replicas, trainers and the evaluation on the GPU
    pods: each reads or writes the recipe's /mnt/shared paths, from one ReadWriteMany claim."""
    cluster, job = manifest("raycluster.yaml"), manifest("rayjob.yaml")
    claim = manifest("shared-storage.yaml")
    assert claim["kind"] == "PersistentVolumeClaim" and claim["spec"]["accessModes"] == [
        "ReadWriteMany"]
    recipe = load_yaml(JobConfig, ROOT / job["spec"]["entrypoint"].split()[-1])
    paths = [recipe.target.model_path, recipe.data.path, recipe.output_dir, recipe.storage_path]
    assert all(p.startswith("/mnt/shared/") for p in paths), paths
    assert mount_problems(cluster, claim["metadata"]["name"], "/mnt/shared") == []


def test_a_pod_without_the_shared_mount_is_named():
    """The control: the layout shipped before (workers only) fails the check, naming the head."""
    cluster = manifest("raycluster.yaml")
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0].pop("volumeMounts")
    assert mount_problems(cluster, "eagle-ray-shared", "/mnt/shared") == [
        "head does not mount eagle-ray-shared at /mnt/shared"]


def test_the_pod_monitor_scrapes_every_pod_of_the_cluster_on_its_metrics_port():
    monitor, cluster = manifest("podmonitor.yaml"), manifest("raycluster.yaml")
    assert monitor["kind"] == "PodMonitor"
    assert monitor["spec"]["selector"]["matchLabels"] == {
        "ray.io/cluster": cluster["metadata"]["name"]}
    port = monitor["spec"]["podMetricsEndpoints"][0]["port"]
    for group, template in pod_templates(cluster).items():
        ports = [p for c in template["spec"]["containers"] for p in c.get("ports", [])]
        assert any(p.get("name") == port for p in ports), group
