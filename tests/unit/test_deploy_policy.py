"""Security and reproducibility policy for deploy/: what a default deployment must never do.

Ray's dashboard and Jobs API run arbitrary code for anyone who reaches them (CVE-2023-48022), so
the manifests must keep token authentication on everywhere, expose nothing outside the cluster,
admit only the cluster's own pods and the KubeRay operator, bound every container's resources, run
as non-root, and pin every image. The Dockerfile must pin its bases, Python and Ray to the project's.
"""

from __future__ import annotations

import re
import sys
import tomllib

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.deploy_support import DEPLOY, REPO, job_config_toml, load_manifests, one, pod_templates

DOCS = load_manifests()
CLUSTER = one(DOCS, "RayCluster").body["spec"]
TEMPLATES = pod_templates(DOCS)
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
DOCKERFILE = (DEPLOY / "Dockerfile").read_text()
POD_LABEL = ("app.kubernetes.io/part-of", "archipelago")


def containers(template: dict) -> list[dict]:
    return template["spec"]["containers"] + template["spec"].get("initContainers", [])


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def dockerfile_args() -> dict[str, str]:
    return dict(re.findall(r"(?m)^ARG (\w+)=(\S+)", DOCKERFILE))


# --- nothing exposed ------------------------------------------------------------------------------

def test_nothing_is_exposed_outside_the_cluster():
    head = CLUSTER["headGroupSpec"]
    assert head["serviceType"] == "ClusterIP" and head.get("enableIngress") is False
    assert "headService" not in head  # a custom head Service could bring its own type
    for doc in DOCS:
        assert doc.kind not in ("Ingress", "Route", "Gateway", "HTTPRoute"), doc
        if doc.kind == "Service":
            assert doc.body["spec"].get("type", "ClusterIP") == "ClusterIP", doc
    for name, template in TEMPLATES.items():
        spec = template["spec"]
        assert not spec.get("hostNetwork"), name
        assert not any(port.get("hostPort") for c in containers(template) for port in c.get("ports", [])), name


# --- token authentication -------------------------------------------------------------------------

def test_token_authentication_is_on_for_the_operator_and_every_ray_container():
    secret = CLUSTER["authOptions"]["secretName"]
    assert CLUSTER["authOptions"]["mode"] == "token"
    assert Version(CLUSTER["rayVersion"]) >= Version("2.52")  # token auth exists from Ray 2.52
    envs = {f"{name}/{c['name']}": env_of(c) for name, t in TEMPLATES.items() for c in t["spec"]["containers"]}
    envs["autoscaler"] = env_of(CLUSTER["autoscalerOptions"])
    for where, env in envs.items():
        assert env.get("RAY_AUTH_MODE") == {"name": "RAY_AUTH_MODE", "value": "token"}, where
        assert env["RAY_AUTH_TOKEN"] == {"name": "RAY_AUTH_TOKEN",
                                         "valueFrom": {"secretKeyRef": {"name": secret, "key": "auth_token"}}}, where


def test_no_secret_is_committed():
    assert not [doc for doc in DOCS if doc.kind == "Secret"]
    for path in DEPLOY.rglob("*"):
        if path.is_file():
            assert not re.search(r"(?i)auth_token\s*[:=]\s*['\"]?\w{16,}", path.read_text()), path


# --- network policy -------------------------------------------------------------------------------

def test_every_ray_pod_is_under_the_network_policy():
    policy = one(DOCS, "NetworkPolicy").body["spec"]
    assert policy["podSelector"] == {"matchLabels": dict([POD_LABEL])}
    assert "Ingress" in policy["policyTypes"]
    for name, template in TEMPLATES.items():
        assert template["metadata"]["labels"].get(POD_LABEL[0]) == POD_LABEL[1], name


def test_the_network_policy_admits_only_the_cluster_and_the_operator():
    own_pods = {"podSelector": {"matchLabels": dict([POD_LABEL])}}
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kuberay-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}}}
    rules = one(DOCS, "NetworkPolicy").body["spec"]["ingress"]
    # An empty or missing `from` admits everyone; an ipBlock or a bare namespaceSelector admits strangers.
    assert [rule["from"] for rule in rules] == [[own_pods], [operator]]
    assert "ports" not in rules[0]  # GCS, raylets, object store and collectives between the pods
    assert rules[1]["ports"] == [{"protocol": "TCP", "port": 8265}]  # the operator reads job status


# --- resources, users, images ---------------------------------------------------------------------

def test_every_container_requests_and_limits_cpu_and_memory():
    bounded = {f"{name}/{c['name']}": c["resources"] for name, t in TEMPLATES.items() for c in containers(t)}
    bounded["autoscaler"] = CLUSTER["autoscalerOptions"]["resources"]
    for where, resources in bounded.items():
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= resources.get(kind, {}).keys(), f"{where}: {kind}"


def test_gpu_groups_ask_for_whole_gpus_and_mig_slices():
    limits = {g["groupName"]: g["template"]["spec"]["containers"][0]["resources"]["limits"]
              for g in CLUSTER["workerGroupSpecs"]}
    assert limits["gpu-whole"]["nvidia.com/gpu"] == "8"
    assert limits["gpu-mig-1g-10gb"]["nvidia.com/mig-1g.10gb"] == "1"
    for group in CLUSTER["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], group["groupName"]


def test_pods_run_as_non_root():
    for name, template in TEMPLATES.items():
        assert template["spec"]["securityContext"]["runAsNonRoot"] is True, name
        assert template["spec"]["securityContext"]["runAsUser"] != 0, name


def test_images_are_pinned_to_the_project_version():
    version = PROJECT["version"]
    images = {f"{name}/{c['name']}": c["image"] for name, t in TEMPLATES.items() for c in containers(t)}
    for where, image in images.items():
        tag = image.rsplit(":", 1)[-1] if ":" in image.rsplit("/", 1)[-1] else ""
        variant = "gpu" if where.startswith("worker") else "cpu"
        assert tag == f"{version}-{variant}", f"{where}: {image}"
    assert CLUSTER["rayVersion"] == dockerfile_args()["RAY_VERSION"]


def test_every_ray_container_starts_through_node_resources():
    assert one(DOCS, "RayCluster").body["metadata"]["annotations"]["ray.io/overwrite-container-cmd"] == "true"
    for name, template in TEMPLATES.items():
        if name != "submitter":
            assert template["spec"]["containers"][0]["command"] == ["/usr/local/bin/archipelago-ray-start"], name
    assert "COPY --chmod=0755 deploy/ray-start.sh /usr/local/bin/archipelago-ray-start" in DOCKERFILE
    assert "node_args=$(archipelago node-resources)" in (DEPLOY / "ray-start.sh").read_text()


def test_checkpoints_go_to_shared_storage():
    _, job = job_config_toml(DOCS)
    storage = job.get("checkpoint", {}).get("storage", "")
    if storage:  # an object store, with credentials from a Secret in every Ray container
        assert storage.startswith("s3://")
        for name, template in TEMPLATES.items():
            if name != "submitter":
                assert {"secretRef": {"name": "archipelago-object-store", "optional": True}} in \
                       template["spec"]["containers"][0]["envFrom"], name
        return
    claim = one(DOCS, "PersistentVolumeClaim")
    assert claim.body["spec"]["accessModes"] == ["ReadWriteMany"]  # every worker writes its shards
    for name, template in TEMPLATES.items():
        if name == "submitter":
            continue
        volume = next(v["name"] for v in template["spec"]["volumes"]
                      if v.get("persistentVolumeClaim", {}).get("claimName") == claim.name)
        mount = next(m["mountPath"] for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == volume)
        assert job["runs_dir"].startswith(mount + "/"), (name, mount, job["runs_dir"])


# --- Dockerfile -----------------------------------------------------------------------------------

def base_images() -> list[str]:
    stages = set(re.findall(r"(?m)^FROM \S+ AS (\S+)", DOCKERFILE))
    images = re.findall(r"(?m)^FROM (\S+)", DOCKERFILE)
    return [image for image in images if image not in stages and not image.startswith("base-${")]


def unpinned(images: list[str]) -> list[str]:
    """Images without a version tag (none, "latest", or a name such as "stable")."""
    def tag(image: str) -> str:
        return image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    return [image for image in images if not re.match(r"\d+\.\d+", tag(image))]


def test_dockerfile_bases_are_pinned_to_versions():
    assert base_images() == ["ghcr.io/astral-sh/uv:0.8.22", "ubuntu:24.04", "nvidia/cuda:13.0.1-runtime-ubuntu24.04"]
    assert unpinned(base_images()) == []
    assert re.search(r"(?m)^FROM base-\$\{VARIANT\}$", DOCKERFILE)
    assert {"base-cpu", "base-gpu"} <= set(re.findall(r"(?m)^FROM \S+ AS (\S+)", DOCKERFILE))


def test_the_pin_check_catches_floating_images():
    assert unpinned(["python:latest", "ubuntu", "registry:5000/ray", "rayproject/ray:nightly-gpu",
                     "nvidia/cuda:13.0.1-runtime-ubuntu24.04"]) == [
        "python:latest", "ubuntu", "registry:5000/ray", "rayproject/ray:nightly-gpu"]


def test_dockerfile_pins_python_and_ray_to_the_project():
    args = dockerfile_args()
    python = Version(args["PYTHON_VERSION"])
    assert python in SpecifierSet(PROJECT["requires-python"])
    assert (python.major, python.minor) == sys.version_info[:2]  # the Python the project is tested on
    ray_spec = next(SpecifierSet(d.split("]", 1)[1]) for d in PROJECT["dependencies"] if d.startswith("ray["))
    assert Version(args["RAY_VERSION"]) in ray_spec, (args["RAY_VERSION"], ray_spec)
    torch_spec = next(SpecifierSet(d[len("torch"):]) for d in PROJECT["dependencies"] if d.startswith("torch"))
    assert Version(args["TORCH_VERSION"]) in torch_spec
    assert 'uv pip install "ray[default,train]==${RAY_VERSION}" ".${extra}"' in DOCKERFILE
    assert 'echo "[gpu]"' in DOCKERFILE  # the gpu variant installs the project's gpu extra
