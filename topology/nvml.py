"""The one place archipelago talks to NVML: a narrow facade over the `pynvml` module.

    nvml, why_not = Nvml.open()            # (None, reason) on a machine without NVML or GPUs
    handle = nvml.handle(0)
    nvml.uuid(handle), nvml.nvlink_ports(handle)

Tests pass `Nvml.open(module=fake)`, a small module with the same function names as pynvml
(nvmlDeviceGetUUID, nvmlDeviceGetNvLinkState, …) and an `NVMLError` class carrying `.value`;
for NVLink fabric domains also `c_nvmlGpuFabricInfo_t` and `byref` (pynvml re-exports ctypes').
Every method returns plain Python values; NVML's "this GPU or driver does not do that" answers
become defaults here, any other NVML error propagates as `nvml.Error`.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

# NVML return codes that mean "not available here", not "broken" (nvml.h).
_ERROR_INVALID_ARGUMENT = 2
_ERROR_NOT_SUPPORTED = 3
_ERROR_NOT_FOUND = 6
_ERROR_FUNCTION_NOT_FOUND = 13
_ABSENT = (_ERROR_INVALID_ARGUMENT, _ERROR_NOT_SUPPORTED, _ERROR_NOT_FOUND, _ERROR_FUNCTION_NOT_FOUND)

NVLINK_MAX_LINKS = 18
"""Links per GPU on every NVIDIA GPU so far (H100/B200: 18). NVML accepts up to 36 ids and
answers NOT_SUPPORTED/INVALID_ARGUMENT past the GPU's last link, which ends the scan."""
_P2P_CAPS_INDEX_READ = 0  # pynvml's own NVML_P2P_CAPS_INDEX_READ is the tuple (0,) (a stray comma)
_P2P_STATUS_OK = 0
_NVLINK_DEVICE_TYPE_SWITCH = 2
_FABRIC_STATE_COMPLETED = 3
_SUCCESS = 0
_UNSUPPORTED = object()
_CLOCK_SM = 1  # NVML_CLOCK_SM
_CLOCK_EVENT_REASONS = ((0x4, "power cap"), (0x8, "hardware slowdown"), (0x20, "thermal"), (0x40, "thermal"),
                        (0x80, "power brake"))
"""nvmlClocksEventReason* bits that hold the clocks down under load (nvml.h); idle and application
settings are left out."""


@dataclass(frozen=True, slots=True)
class NvlinkPort:
    link: int
    remote_pci_bus_id: str
    remote_is_switch: bool


def normalize_bus_id(bus_id: str | bytes) -> str:
    """NVML writes 00000000:18:00.0, the kernel 0000:18:00.0: keep the kernel's form, lower case."""
    text = _text(bus_id).strip().lower()
    parts = text.split(":")
    if len(parts) == 3:
        return f"{int(parts[0], 16):04x}:{parts[1]}:{parts[2]}"
    if len(parts) == 2:
        return f"0000:{text}"
    return text


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    def __init__(self, module: ModuleType):
        self._nvml = module
        self.Error: type[Exception] = module.NVMLError

    @classmethod
    def open(cls, module: ModuleType | None = None) -> tuple[Nvml | None, str]:
        if module is None:
            try:
                import pynvml as module
            except ImportError:
                return None, "nvidia-ml-py (pynvml) is not installed"
        try:
            module.nvmlInit()
        except module.NVMLError as e:
            return None, f"NVML did not start ({e}): no NVIDIA driver on this machine"
        return cls(module), ""

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self.Error:
            pass

    def _absent(self, call, default, *args):
        """NVML's answer, or `default` where this GPU or driver does not support the query."""
        try:
            return call(*args)
        except self.Error as e:
            if getattr(e, "value", None) in _ABSENT:
                return default
            raise

    # ---- the driver -----------------------------------------------------------------------------
    def driver_version(self) -> str:
        return _text(self._absent(self._nvml.nvmlSystemGetDriverVersion, ""))

    def gpu_count(self) -> int:
        return self._nvml.nvmlDeviceGetCount()

    def handle(self, index: int):
        return self._nvml.nvmlDeviceGetHandleByIndex(index)

    # ---- one GPU (or MIG device) ---------------------------------------------------------------
    def uuid(self, handle) -> str:
        return _text(self._nvml.nvmlDeviceGetUUID(handle))

    def name(self, handle) -> str:
        return _text(self._nvml.nvmlDeviceGetName(handle))

    def pci_bus_id(self, handle) -> str:
        return normalize_bus_id(self._nvml.nvmlDeviceGetPciInfo(handle).busId)

    def memory_bytes(self, handle) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(handle).total)

    def sm_count(self, handle) -> int:
        attributes = self._absent(self._nvml.nvmlDeviceGetAttributes, None, handle)
        return int(attributes.multiprocessorCount) if attributes is not None else 0

    def compute_capability(self, handle) -> str:
        major, minor = self._absent(self._nvml.nvmlDeviceGetCudaComputeCapability, (0, 0), handle)
        return f"{major}.{minor}" if major else ""

    def numa_node(self, handle) -> int | None:
        node = self._absent(self._nvml.nvmlDeviceGetNumaNodeId, -1, handle)
        return node if node >= 0 else None

    def cpu_affinity(self, handle, cpu_count: int) -> list[int]:
        """CPUs nearest the GPU. NVML fills an array of 64-bit masks, CPU i at bit i % 64 of word i // 64."""
        words = max(1, (cpu_count + 63) // 64)
        masks = self._absent(self._nvml.nvmlDeviceGetCpuAffinity, [], handle, words)
        return [64 * w + bit for w, mask in enumerate(masks) for bit in range(64) if int(mask) >> bit & 1]

    def pcie_link(self, handle) -> tuple[int, int]:
        """(generation, width) the GPU and its slot can reach; the current link idles lower."""
        return (self._absent(self._nvml.nvmlDeviceGetMaxPcieLinkGeneration, 0, handle),
                self._absent(self._nvml.nvmlDeviceGetMaxPcieLinkWidth, 0, handle))

    def nvlink_ports(self, handle) -> list[NvlinkPort]:
        """The GPU's active NVLinks and what sits at the other end of each."""
        ports = []
        for link in range(NVLINK_MAX_LINKS):
            state = self._absent(self._nvml.nvmlDeviceGetNvLinkState, None, handle, link)
            if state is None:
                break
            if not state:
                continue
            remote = self._nvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            kind = self._absent(self._nvml.nvmlDeviceGetNvLinkRemoteDeviceType, None, handle, link)
            ports.append(NvlinkPort(link=link, remote_pci_bus_id=normalize_bus_id(remote.busId),
                                    remote_is_switch=kind == _NVLINK_DEVICE_TYPE_SWITCH))
        return ports

    def fabric_domain(self, handle) -> str:
        """"<cluster uuid>.<clique id>" of a GPU in a multi-node NVLink fabric, else ""."""
        if not hasattr(self._nvml, "nvmlDeviceGetGpuFabricInfo"):
            return ""
        info = self._nvml.c_nvmlGpuFabricInfo_t()
        if self._absent(self._nvml.nvmlDeviceGetGpuFabricInfo, _UNSUPPORTED, handle, self._nvml.byref(info)) \
                is _UNSUPPORTED:
            return ""
        cluster = bytes(info.clusterUuid).hex()
        if info.state != _FABRIC_STATE_COMPLETED or info.status != _SUCCESS or not int(cluster, 16):
            return ""
        return f"{cluster}.{info.cliqueId}"

    # ---- clocks and power under load (benchmarks sample them) ------------------------------------
    def sm_clock_mhz(self, handle) -> int:
        return int(self._absent(self._nvml.nvmlDeviceGetClockInfo, 0, handle, _CLOCK_SM))

    def power_watts(self, handle) -> float:
        return self._absent(self._nvml.nvmlDeviceGetPowerUsage, 0, handle) / 1000

    def clock_limits(self, handle) -> frozenset[str]:
        """What holds the clocks below their maximum now ("power cap", "thermal", ...); empty if nothing."""
        reasons = self._absent(self._nvml.nvmlDeviceGetCurrentClocksEventReasons, 0, handle)
        return frozenset(name for bit, name in _CLOCK_EVENT_REASONS if reasons & bit)

    # ---- pairs of GPUs -------------------------------------------------------------------------
    def common_ancestor(self, handle_a, handle_b) -> int | None:
        """NVML_TOPOLOGY_* level (0 same board … 50 across sockets), None where NVML cannot say."""
        return self._absent(self._nvml.nvmlDeviceGetTopologyCommonAncestor, None, handle_a, handle_b)

    def p2p_readable(self, handle_a, handle_b) -> bool:
        status = self._absent(self._nvml.nvmlDeviceGetP2PStatus, None, handle_a, handle_b, _P2P_CAPS_INDEX_READ)
        return status == _P2P_STATUS_OK

    # ---- MIG -----------------------------------------------------------------------------------
    def mig_enabled(self, handle) -> bool:
        current, _pending = self._absent(self._nvml.nvmlDeviceGetMigMode, (0, 0), handle)
        return bool(current)

    def mig_devices(self, handle) -> list:
        """Handles of the MIG devices (GPU instance + compute instance) that exist on a MIG-mode GPU."""
        count = self._nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        handles = (self._absent(self._nvml.nvmlDeviceGetMigDeviceHandleByIndex, None, handle, i) for i in range(count))
        return [h for h in handles if h is not None]

    def mig_instance_ids(self, mig_handle) -> tuple[int | None, int | None]:
        return (self._absent(self._nvml.nvmlDeviceGetGpuInstanceId, None, mig_handle),
                self._absent(self._nvml.nvmlDeviceGetComputeInstanceId, None, mig_handle))
