"""A cluster map from files: saved topology JSON and `nvidia-smi -L; nvidia-smi topo -m` texts, mixed.

    cluster = topology.load_files(["cluster.json", "node-a.txt", "node-b.txt"])

A JSON file adds all its nodes; a text file adds one node, named after the file (node-a.txt → node-a).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

from core.atomic import read_text
from core.errors import TopologyError
from topology import nvidia_smi
from topology.cluster import ClusterTopology, NodeTopology


def load_files(paths: Iterable[str | Path]) -> ClusterTopology:
    nodes: list[NodeTopology] = []
    for path in map(Path, paths):
        text = read_text(path, error=TopologyError, fix="pass a topology JSON or nvidia-smi text file")
        if text.lstrip().startswith("{"):
            nodes.extend(ClusterTopology.from_json(text, where=str(path)).nodes)
        else:
            nodes.append(nvidia_smi.parse_node(text, node_id=_node_id(path, nodes), source=str(path)))
    return ClusterTopology(nodes=nodes)


def _node_id(path: Path, nodes: list[NodeTopology]) -> str:
    """The file's name up to its first dot (node-a.txt → node-a), unique among the nodes so far."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "-", path.name.split(".")[0]) or "node"
    taken = {node.node_id for node in nodes}
    return next(candidate for candidate in (base if k == 0 else f"{base}-{k}" for k in range(len(taken) + 1))
                if candidate not in taken)
