"""What a Ray Train worker of the placement test runs: only Ray and workers/binding.py, so that starting
it imports neither torch nor the driver."""

from __future__ import annotations

import json
from pathlib import Path

import ray

from core.errors import PlacementError
from workers import binding


def report_placement(config: dict) -> None:
    """A Ray Train worker's first steps in workers/loop.py (claim its entry, check what Ray gave it), for
    config["plan"] and for config["misplaced"], a plan on other GPUs; what it saw goes to
    <config["out"]>/<world rank>.json."""
    context = ray.get_runtime_context()
    assigned, gpu_ids = context.get_assigned_resources(), binding.ray_gpus_by_uuid(ray.get_gpu_ids())
    train = ray.train.get_context()
    seen = {"node": context.get_node_id(), "resources": assigned, "gpu_ids": [str(i) for i in gpu_ids]}
    for name in ("plan", "misplaced"):
        plan = config[name]
        entry = binding.claim(plan, ray_node_id=context.get_node_id(), local_rank=train.get_local_rank(),
                              gpu_ids=gpu_ids)
        try:
            binding.check_placement(entry, node=context.get_node_id(), assigned=assigned,
                                    gpu_ids=gpu_ids,
                                    islands_requested=binding.islands_reserved(plan, assigned))
            seen[name] = {"gpu": entry.gpu_index, "error": None}
        except PlacementError as e:
            seen[name] = {"gpu": entry.gpu_index, "error": e.what, "fix": e.fix}
    Path(config["out"], f"{train.get_world_rank()}.json").write_text(json.dumps(seen))
