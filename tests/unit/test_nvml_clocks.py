"""The NVML facade's clock and power readings, on a fake pynvml: units, reasons, and GPUs that cannot say."""

from __future__ import annotations

from types import SimpleNamespace

from topology.nvml import Nvml


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value


def fake_nvml(*, clock=1980, milliwatts=687_250, reasons=0x4 | 0x20 | 0x1, supported=True) -> SimpleNamespace:
    def answer(value):
        def call(*_):
            if not supported:
                raise NVMLError(3)  # NVML_ERROR_NOT_SUPPORTED
            return value
        return call

    return SimpleNamespace(NVMLError=NVMLError, nvmlInit=lambda: None,
                           nvmlDeviceGetClockInfo=answer(clock), nvmlDeviceGetPowerUsage=answer(milliwatts),
                           nvmlDeviceGetCurrentClocksEventReasons=answer(reasons))


def test_clocks_power_and_what_holds_them_down():
    nvml, _ = Nvml.open(module=fake_nvml())
    assert nvml.sm_clock_mhz("gpu") == 1980
    assert nvml.power_watts("gpu") == 687.25
    # Idle (0x1) is not a limit under load; power cap (0x4) and software thermal (0x20) are.
    assert nvml.clock_limits("gpu") == {"power cap", "thermal"}


def test_a_gpu_that_cannot_say_reads_as_zero_and_no_limits():
    nvml, _ = Nvml.open(module=fake_nvml(supported=False))
    assert (nvml.sm_clock_mhz("gpu"), nvml.power_watts("gpu"), nvml.clock_limits("gpu")) == (0, 0.0, frozenset())
