"""deploy/kuberay/: every manifest parses, the KubeRay resources fit the KubeRay CRD schemas, the
job in the ConfigMap is a valid archipelago job sized to the worker groups, and the start script
hands `archipelago node-resources` to `ray start` intact."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import JobConfig
from tests.deploy_support import (
    DEPLOY,
    MANIFESTS,
    Manifest,
    crd_schemas,
    devices_per_pod,
    job_config_toml,
    load_manifests,
    one,
    schema_errors,
)

DOCS = load_manifests()


def test_every_manifest_parses_into_named_objects():
    assert {path.name for path in MANIFESTS.glob("*.yaml")} == {doc.file for doc in DOCS}
    assert sorted(doc.kind for doc in DOCS) == ["ConfigMap", "NetworkPolicy", "PersistentVolumeClaim",
                                                "RayCluster", "RayJob"]
    for doc in DOCS:
        assert doc.body["apiVersion"] and doc.name, doc


@pytest.mark.parametrize("kind", ["RayCluster", "RayJob"])
def test_kuberay_resources_fit_the_crd_schema(kind):
    doc = one(DOCS, kind)
    assert schema_errors(doc, crd_schemas()) == []


def broken_cluster(change) -> Manifest:
    body = copy.deepcopy(one(DOCS, "RayCluster").body)
    change(body["spec"])
    return Manifest("raycluster.yaml", body)


@pytest.mark.parametrize("change, error", [
    (lambda spec: spec.update(authOption={"mode": "token"}), "spec: Additional properties are not allowed ('authOption'"),
    (lambda spec: spec["authOptions"].update(mode="password"), "spec/authOptions/mode: 'password' is not one of"),
    (lambda spec: spec["workerGroupSpecs"][0].update(minReplicas="1"), "spec/workerGroupSpecs/0/minReplicas: '1' is not of type 'integer'"),
    (lambda spec: spec["workerGroupSpecs"][1].pop("groupName"), "spec/workerGroupSpecs/1: 'groupName' is a required property"),
    (lambda spec: spec["headGroupSpec"]["template"]["spec"]["containers"][0]["resources"]["limits"].update(memory="16 GB"),
     "spec/headGroupSpec/template/spec/containers/0/resources/limits/memory: '16 GB' does not match"),
    (lambda spec: spec.update(managedBy="someone"), "spec/managedBy: sets a field with CEL rules"),
])
def test_the_schema_check_names_what_is_wrong(change, error):
    errors = schema_errors(broken_cluster(change), crd_schemas())
    assert len(errors) == 1 and errors[0].startswith(error), errors


def test_the_schema_check_refuses_another_api_version():
    body = copy.deepcopy(one(DOCS, "RayJob").body) | {"apiVersion": "ray.io/v1alpha1"}
    assert schema_errors(Manifest("rayjob.yaml", body), crd_schemas()) == [
        "apiVersion: 'ray.io/v1alpha1', the CRD serves 'ray.io/v1'"]


def test_the_job_config_is_a_valid_job_sized_to_the_worker_groups():
    _, data = job_config_toml(DOCS)
    job = JobConfig.from_dict(data)
    groups = one(DOCS, "RayCluster").body["spec"]["workerGroupSpecs"]
    assert job.cluster.use_gpu
    assert job.elastic.min_workers == sum(g["minReplicas"] * devices_per_pod(g) for g in groups) == 8
    assert job.cluster.num_workers == job.placement.max_gpus == sum(g["maxReplicas"] * devices_per_pod(g) for g in groups) == 20
    for group in groups:  # each pod has the cores for one worker per device
        cores = int(group["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"])
        assert cores >= devices_per_pod(group) * job.cluster.cpus_per_worker, group["groupName"]


def test_the_rayjob_runs_the_config_map_on_the_cluster():
    cluster, job = one(DOCS, "RayCluster"), one(DOCS, "RayJob").body["spec"]
    config_map, _ = job_config_toml(DOCS)
    assert job["clusterSelector"] == {"ray.io/cluster": cluster.name}
    head = cluster.body["spec"]["headGroupSpec"]["template"]["spec"]
    volume = next(v["name"] for v in head["volumes"] if v.get("configMap", {}).get("name") == config_map.name)
    mount = next(m["mountPath"] for m in head["containers"][0]["volumeMounts"] if m["name"] == volume)
    assert job["entrypoint"] == f"archipelago fit {mount}/job.toml"


def run_start_script(tmp_path: Path, node_resources: str, generated: str, status: int = 0):
    """deploy/ray-start.sh with a stand-in `archipelago` that prints `node_resources` (or fails)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "archipelago"
    stub.write_text(f"#!/bin/sh\nprintf '%s\\n' '{node_resources}'\nexit {status}\n")
    stub.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "KUBERAY_GEN_RAY_START_CMD": generated}
    return subprocess.run(["bash", str(DEPLOY / "ray-start.sh")], env=env, capture_output=True, text=True, timeout=30)


# KubeRay's generated command is shell text with its own quoting; here it runs a program that prints argv.
PRINT_ARGV = f"{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))'"
KUBERAY_FLAGS = '--head --resources="{\\"mig_1g.10gb\\": 1}" --block'


def test_the_start_script_appends_node_resources_to_kuberays_command(tmp_path):
    flags = '--resources={"mig_1g.10gb":1.0,"nvlink_island_n0-0":8.0} --labels=archipelago.io/gpu-model=H100,archipelago.io/mig=true'
    result = run_start_script(tmp_path, flags, f"{PRINT_ARGV} {KUBERAY_FLAGS}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ('["--head", "--resources={\\"mig_1g.10gb\\": 1}", "--block", '
                                     '"--resources={\\"mig_1g.10gb\\":1.0,\\"nvlink_island_n0-0\\":8.0}", '
                                     '"--labels=archipelago.io/gpu-model=H100,archipelago.io/mig=true"]')


def test_the_start_script_adds_nothing_on_a_node_without_gpus(tmp_path):
    result = run_start_script(tmp_path, "", f"{PRINT_ARGV} {KUBERAY_FLAGS}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == '["--head", "--resources={\\"mig_1g.10gb\\": 1}", "--block"]'


def test_the_start_script_fails_when_the_gpus_cannot_be_mapped(tmp_path):
    result = run_start_script(tmp_path, "error: NVML not found", f"{PRINT_ARGV} {KUBERAY_FLAGS}", status=2)
    assert result.returncode == 1 and result.stdout == ""  # ray start never ran
    assert "archipelago node-resources failed: error: NVML not found" in result.stderr


def test_the_start_script_needs_kuberays_command(tmp_path):
    result = run_start_script(tmp_path, "", "")
    assert result.returncode != 0 and "ray.io/overwrite-container-cmd" in result.stderr
