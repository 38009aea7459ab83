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
