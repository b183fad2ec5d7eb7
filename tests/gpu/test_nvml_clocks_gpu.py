"""The NVML facade's clock and power readings on a real GPU, under load: what benchmarks/step.py samples.

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_nvml_clocks_gpu.py -p no:cacheprovider
"""

import pytest
import torch

from topology.nvml import Nvml

pytestmark = pytest.mark.gpu


def test_clock_and_power_read_plausibly_while_the_gpu_works():
    nvml, why_not = Nvml.open()
    assert nvml is not None, why_not
    handle = nvml.handle(torch.cuda.current_device())
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):
        a @ a
    clock, watts = nvml.sm_clock_mhz(handle), nvml.power_watts(handle)
    torch.cuda.synchronize()
    nvml.close()
    assert 300 <= clock <= 3000, clock
    assert 20 <= watts <= 2000, watts
