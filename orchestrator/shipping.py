"""The job's own code the workers need: the module of a custom model's factory, when it is not installed.

    runtime_env = {"py_modules": modules_to_ship(workload)}     # ray.init(..., runtime_env=runtime_env)

Ray uploads those modules with the job and puts them on every worker's path, on any cluster. A
factory defined in the driver's own script (__main__) needs none: it travels inside the spec,
pickled by value. An installed package (site-packages) needs none either, nor archipelago's own models
(gpt, llama, hf), which an editable install keeps outside site-packages.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from types import ModuleType

from core.workload import Workload
from workers.models.hf import HFWorkload
from workers.models.workloads import BuiltinWorkload, ModuleWorkload

INSTALLED = tuple(Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib", "stdlib"))


def modules_to_ship(workload: Workload) -> list[ModuleType]:
    """The top-level package (or single-file module) holding the user's model code, if Ray must ship it."""
    if isinstance(workload, (BuiltinWorkload, HFWorkload)):  # archipelago's own code: every worker has it
        return []
    owner = workload.factory if isinstance(workload, ModuleWorkload) else type(workload)
    top = sys.modules.get(getattr(owner, "__module__", "").split(".")[0])
    if top is None or top.__name__ == "__main__" or getattr(top, "__file__", None) is None:
        return []
    path = Path(top.__file__).resolve()
    return [] if any(path.is_relative_to(root) for root in INSTALLED) else [top]
