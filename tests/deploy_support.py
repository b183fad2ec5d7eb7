"""Load deploy/'s Kubernetes manifests and check KubeRay resources against the KubeRay CRD schemas.

    docs = load_manifests()                        # every YAML document under deploy/kuberay/
    schema_errors(doc, crd_schemas())              # [] when a RayCluster / RayJob fits its CRD

The CRDs (ray.io_rayclusters.yaml, ray.io_rayjobs.yaml) are verbatim copies from KubeRay in
tests/fixtures/kuberay-crds/ (SOURCE.md there names the commit); ARCHIPELAGO_KUBERAY_CRDS points
elsewhere, to check against another KubeRay's. Their openAPIV3Schema is checked with jsonschema, with
Kubernetes' own rules where jsonschema differs:
- unknown fields are errors, as under `kubectl apply --validate=strict` (the API server would
  otherwise prune them without a word: a misspelt authOptions would turn authentication off);
- x-kubernetes-int-or-string comes with anyOf [integer, string] in these CRDs, which jsonschema checks;
- x-kubernetes-validations (CEL) cannot be evaluated here, so a document that sets a field carrying
  CEL rules is reported rather than passed unchecked.
"""

from __future__ import annotations

import copy
import os
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
MANIFESTS = DEPLOY / "kuberay"
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
# libyaml's safe loader reads the 2.3 MB of CRDs ~15x faster than the pure-Python one.
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def crd_directory() -> Path:
    return Path(os.environ.get("ARCHIPELAGO_KUBERAY_CRDS", REPO / "tests" / "fixtures" / "kuberay-crds"))


@dataclass(frozen=True)
class Manifest:
    file: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return self.body.get("kind", "")

    @property
    def name(self) -> str:
        return self.body.get("metadata", {}).get("name", "")

    def __str__(self) -> str:
        return f"{self.file} {self.kind}/{self.name}"


def load_manifests(directory: Path = MANIFESTS) -> list[Manifest]:
    docs = []
    for path in sorted(directory.glob("*.yaml")):
        with path.open() as stream:
            docs += [Manifest(path.name, body) for body in yaml.safe_load_all(stream) if body is not None]
    return docs


def one(docs: list[Manifest], kind: str) -> Manifest:
    found = [doc for doc in docs if doc.kind == kind]
    assert len(found) == 1, f"expected one {kind} in {MANIFESTS}, found {[str(d) for d in found]}"
    return found[0]


@dataclass(frozen=True)
class CrdSchema:
    api_version: str
    schema: dict[str, Any]


@cache
def crd_schemas() -> dict[str, CrdSchema]:
    """kind -> the storage version's schema, made strict about unknown fields."""
    schemas = {}
    for kind, file in CRD_FILES.items():
        crd = yaml.load((crd_directory() / file).read_text(), Loader=SAFE_LOADER)
        assert crd["spec"]["names"]["kind"] == kind, f"{file} defines {crd['spec']['names']['kind']}, not {kind}"
        version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
        schemas[kind] = CrdSchema(f"{crd['spec']['group']}/{version['name']}",
                                  strict(copy.deepcopy(version["schema"]["openAPIV3Schema"])))
    return schemas


def strict(schema: Any) -> Any:
    """Forbid fields a schema does not list, except where Kubernetes keeps unknown fields."""
    if isinstance(schema, dict):
        for value in schema.values():
            strict(value)
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
    elif isinstance(schema, list):
        for value in schema:
            strict(value)
    return schema


def schema_errors(doc: Manifest, schemas: dict[str, CrdSchema]) -> list[str]:
    """Every way `doc` breaks its CRD, one line each ("spec/headGroupSpec/serviceType: ..."); [] if none."""
    crd = schemas[doc.kind]
    errors = []
    if doc.body.get("apiVersion") != crd.api_version:
        errors.append(f"apiVersion: {doc.body.get('apiVersion')!r}, the CRD serves {crd.api_version!r}")
    validator = jsonschema.Draft7Validator(crd.schema)
    for error in sorted(validator.iter_errors(doc.body), key=lambda e: list(map(str, e.absolute_path))):
        errors.append(f"{'/'.join(map(str, error.absolute_path)) or '(top)'}: {error.message}")
    errors += [f"{path}: sets a field with CEL rules this test cannot evaluate ({rules})"
               for path, rules in cel_rules_in_use(doc.body, crd.schema)]
    return errors


def cel_rules_in_use(instance: Any, schema: dict[str, Any], path: str = "") -> Iterator[tuple[str, str]]:
    if "x-kubernetes-validations" in schema:
        yield path or "(top)", "; ".join(rule["rule"] for rule in schema["x-kubernetes-validations"])
    if isinstance(instance, dict):
        extra = schema.get("additionalProperties")
        for key, value in instance.items():
            child = schema.get("properties", {}).get(key) or (extra if isinstance(extra, dict) else None)
            if child:
                yield from cel_rules_in_use(value, child, f"{path}/{key}".lstrip("/"))
    elif isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for index, value in enumerate(instance):
            yield from cel_rules_in_use(value, schema["items"], f"{path}/{index}")


def pod_templates(docs: list[Manifest]) -> dict[str, dict[str, Any]]:
    """Every pod template that runs Ray or talks to it: 'head', 'worker <group>', 'submitter'."""
    cluster = one(docs, "RayCluster").body["spec"]
    templates = {"head": cluster["headGroupSpec"]["template"]}
    templates.update({f"worker {group['groupName']}": group["template"] for group in cluster["workerGroupSpecs"]})
    templates["submitter"] = one(docs, "RayJob").body["spec"]["submitterPodTemplate"]
    return templates


def job_config_toml(docs: list[Manifest]) -> tuple[Manifest, dict[str, Any]]:
    config_map = one(docs, "ConfigMap")
    return config_map, tomllib.loads(config_map.body["data"]["job.toml"])


def devices_per_pod(group: dict[str, Any]) -> int:
    """GPUs or MIG slices one pod of a worker group gets (its nvidia.com/* limit)."""
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    counts = [int(value) for key, value in limits.items() if key.startswith("nvidia.com/")]
    assert len(counts) == 1, f"worker group {group['groupName']}: expected one nvidia.com/* limit, got {limits}"
    return counts[0]
