"""Turn a node's islands and MIG slices into `ray start --resources/--labels`, so Ray can schedule by them.

    ray start --head $(archipelago node-resources)     # what the KubeRay manifests run

Custom resources: `nvlink_island_<island id>` = GPUs in each NVLink island of 2+ GPUs, and
`mig_<profile>` = slices of each MIG profile. Labels (Kubernetes syntax, our own prefix since
Ray reserves ray.io/): the node's NVLink domain (its largest island, or the fabric domain shared
by every tray of an NVL rack) for `placement_group(topology_strategy={LABEL: "STRICT_PACK"})`,
that island's size, the GPU model, and whether the node has MIG slices.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass

from topology.cluster import ClusterTopology, NodeTopology

LABEL_PREFIX = "archipelago.io/"
NVLINK_DOMAIN_LABEL = LABEL_PREFIX + "nvlink-domain"
_LABEL_VALUE_MAX = 63
_NOT_LABEL_CHARACTERS = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True, slots=True)
class RayStartArguments:
    resources: dict[str, float]
    labels: dict[str, str]

    def as_arguments(self) -> str:
        """Flags for `ray start` that survive unquoted $(…) substitution: no spaces, no quotes."""
        flags = []
        if self.resources:
            flags.append("--resources=" + json.dumps(self.resources, separators=(",", ":"), sort_keys=True))
        if self.labels:
            flags.append("--labels=" + ",".join(f"{key}={value}" for key, value in sorted(self.labels.items())))
        return " ".join(flags)

    def as_json(self) -> str:
        return json.dumps({"resources": self.resources, "labels": self.labels}, indent=1, sort_keys=True)


def ray_start_arguments(node: NodeTopology) -> RayStartArguments:
    islands = [island for island in ClusterTopology(nodes=[node]).nvlink_islands if island.size > 1]
    resources: dict[str, float] = {island_resource(island.island_id): float(island.size) for island in islands}
    profiles = Counter(mig.profile for mig in node.mig_slices if mig.profile)
    resources.update({f"mig_{profile}": float(count) for profile, count in sorted(profiles.items())})
    labels: dict[str, str] = {}
    if islands:
        largest = max(islands, key=lambda island: island.size)
        labels[NVLINK_DOMAIN_LABEL] = label_value(largest.island_id)
        labels[LABEL_PREFIX + "nvlink-island-gpus"] = str(largest.size)
    models = {gpu.model for gpu in node.gpus if gpu.model}
    if len(models) == 1:
        labels[LABEL_PREFIX + "gpu-model"] = label_value(models.pop())
    if node.mig_slices:
        labels[LABEL_PREFIX + "mig"] = "true"
    return RayStartArguments(resources=resources, labels=labels)


def island_resource(island_id: str) -> str:
    """The Ray custom resource that counts the GPUs of one NVLink island (one unit a GPU)."""
    return f"nvlink_island_{label_value(island_id)}"


def label_value(text: str) -> str:
    """A valid Kubernetes/Ray label value (≤ 63 of [A-Za-z0-9_.-], alphanumeric at both ends),
    shortened with a hash when needed so that different ids stay different."""
    value = _NOT_LABEL_CHARACTERS.sub("-", text).strip("-_.")
    if len(value) > _LABEL_VALUE_MAX:
        digest = hashlib.sha1(text.encode()).hexdigest()[:8]
        value = value[:_LABEL_VALUE_MAX - 9].rstrip("-_.") + "-" + digest
    return value
