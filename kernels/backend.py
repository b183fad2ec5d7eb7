"""Which implementation runs a kernel: Triton on CUDA tensors where triton is installed, the
plain-torch twin everywhere else (CPU, or a CUDA build of torch without triton, with a warning)."""

from __future__ import annotations

import functools
import importlib.util
import warnings

import torch


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and _triton_available()


@functools.cache
def _triton_available() -> bool:
    if importlib.util.find_spec("triton") is None:
        warnings.warn("triton is not installed: CUDA tensors take the torch twins of archipelago's kernels, several "
                      "times slower; install triton (it ships with Linux CUDA builds of torch)", stacklevel=4)
        return False
    return True
