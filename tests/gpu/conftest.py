"""GPU tests run only where CUDA is: on a machine without it, each is skipped, saying so."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _needs_cuda():
    if not torch.cuda.is_available():
        pytest.skip("CUDA is not available: run tests/gpu on a GPU machine (make test-gpu)")
