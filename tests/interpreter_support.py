"""What the tests that run Triton kernels in Triton's CPU interpreter share: a child process
(TRITON_INTERPRET must be set before the kernels are defined, and must not leak into compiled
runs in the test process) that starts with INTERPRETER_FIX and prints its results as JSON."""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

INTERPRETER_FIX = r"""
import triton.runtime.interpreter as interpreter

# Triton 3.6's interpreter turns a scalar into an int with int(array of shape (1,)), which numpy
# >= 2.3 refuses; loops with run-time bounds need it.
_patch_tensor = interpreter._patch_lang_tensor
def _patch_tensor_index(tensor, scope):
    _patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))
interpreter._patch_lang_tensor = _patch_tensor_index
"""


def run_interpreted(script: str, *args: str, timeout_s: float = 600, attempts: int = 1) -> list[dict]:
    """Runs INTERPRETER_FIX + script in a child under TRITON_INTERPRET=1 from the repository root;
    returns the JSON list the script printed last. A child past timeout_s is run again, up to
    `attempts` runs in all; results are only ever taken from a child that finished."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    for attempt in range(1, attempts + 1):
        try:
            child = subprocess.run([sys.executable, "-c", INTERPRETER_FIX + script, *args], env=env, cwd=root,
                                   capture_output=True, text=True, timeout=timeout_s)
            break
        except subprocess.TimeoutExpired:
            if attempt == attempts:
                raise
            warnings.warn(f"an interpreted run passed {timeout_s:.0f} s; running it again ({attempt + 1} of {attempts})")
    assert child.returncode == 0, child.stderr[-3000:]
    return json.loads(child.stdout.strip().splitlines()[-1])
