"""Write the KubeRay CRD schemas the tests validate `examples/kuberay/` against.

The upstream CRDs (ray-operator/config/crd/bases in ray-project/kuberay) are 1-1.5 MB each,
almost all of it embedded Kubernetes core types (pod templates). This keeps the `v1` schema of
RayCluster and RayJob and replaces every Kubernetes core type -- any sub-schema of `spec` still
larger than LIMIT bytes once its own children are trimmed: pod templates and what embeds them --
with an object that accepts anything, so what KubeRay itself defines (group specs, autoscaler
options, replicas, entrypoint) is checked.

    python scripts/trim_kuberay_crds.py <kuberay checkout> v1.7.0
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

LIMIT = 20_000
OUT = Path(__file__).resolve().parent.parent / "examples" / "kuberay" / "schemas"
CRDS = {"raycluster": "ray.io_rayclusters.yaml", "rayjob": "ray.io_rayjobs.yaml"}


def trim(schema: dict, root: bool = False) -> dict:
    """Trim children first, then this schema if it is still a large (core) type."""
    schema = dict(schema)
    if "properties" in schema:
        schema["properties"] = {k: trim(v) for k, v in schema["properties"].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = trim(schema[key])
    if not root and len(json.dumps(schema)) > LIMIT:
        return {"type": schema.get("type", "object"), "x-kubernetes-preserve-unknown-fields": True,
                "description": "Kubernetes core type: not checked by the trimmed schema."}
    return schema


def main(checkout: str, version: str) -> None:
    for kind, name in CRDS.items():
        crd = yaml.safe_load((Path(checkout) / "ray-operator/config/crd/bases" / name).read_text())
        v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
        schema = v1["schema"]["openAPIV3Schema"]
        schema = {**schema, "properties": {**schema["properties"],
                                           "spec": trim(schema["properties"]["spec"], root=True)}}
        schema["properties"].pop("status", None)
        out = OUT / f"{kind}-{version}.json"
        out.write_text(json.dumps({"kuberay": version, "group": crd["spec"]["group"],
                                   "kind": crd["spec"]["names"]["kind"], "schema": schema},
                                  indent=1, sort_keys=True) + "\n")
        print(f"{out}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    main(*sys.argv[1:3])
