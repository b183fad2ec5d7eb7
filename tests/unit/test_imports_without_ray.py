"""The worker side imports without Ray: a worker runs a step from a Plan and a device alone, and the GPU
machines the benchmarks and tests/gpu run on have no Ray. An import of Ray on that path (the planner
once reached it through topology's discovery) stops every GPU benchmark before it measures anything."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER_SIDE = ["core", "kernels", "storage", "topology", "planning", "workers.engine",
               "benchmarks.device_probe", "benchmarks.goodput", "benchmarks.step", "tests.engine_support"]


def test_the_worker_side_and_the_gpu_benchmarks_import_without_ray():
    blocked = "import sys; sys.modules['ray'] = None\n"  # `import ray` then raises ImportError
    script = blocked + "import importlib\nfor name in %r:\n    importlib.import_module(name)\n" % WORKER_SIDE
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
