"""A benchmark script under benchmarks/ loaded as a module, so tests can check its helpers on CPU."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported under its own module name (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(f"{name}_benchmark", _BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # torch.compile looks functions' modules up by name
    spec.loader.exec_module(module)
    return module
