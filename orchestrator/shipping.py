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


ARCHIPELAGO_PACKAGES = ("core", "kernels", "storage", "topology", "workers", "planning", "orchestrator")
"""Every worker has these (the job runs archipelago): never shipped, even from a directory that holds them."""


def modules_to_ship(workload: Workload) -> list[ModuleType]:
    """The top-level package (or single-file module) holding the user's model code, if Ray must ship it, and the
    other modules of its directory that the driver has imported (a layers.py beside my_models.py)."""
    if isinstance(workload, (BuiltinWorkload, HFWorkload)):  # archipelago's own code: every worker has it
        return []
    owner = workload.factory if isinstance(workload, ModuleWorkload) else type(workload)
    top = sys.modules.get(getattr(owner, "__module__", "").split(".")[0])
    if top is None or top.__name__ == "__main__" or getattr(top, "__file__", None) is None:
        return []
    path = Path(top.__file__).resolve()
    if any(path.is_relative_to(root) for root in INSTALLED):
        return []
    return [top, *_imported_beside(top, _directory(path))]


def _directory(path: Path) -> Path:
    """Where a top-level module sits: a package's parent directory, a single file's own."""
    return path.parent.parent if path.name == "__init__.py" else path.parent


def _imported_beside(top: ModuleType, home: Path) -> list[ModuleType]:
    """The other top-level modules and packages loaded from `home`: a worker on another node has none of them."""
    beside = []
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if "." in name or module is top or name == "__main__" or name in ARCHIPELAGO_PACKAGES or not file:
            continue
        if _directory(Path(file).resolve()) == home:
            beside.append(module)
    return sorted(beside, key=lambda m: m.__name__)
