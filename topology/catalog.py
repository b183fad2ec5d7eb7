"""What each GPU model can do on paper: dense peak TFLOP/s per dtype, memory, SMs, NVLink, MIG.

    model = catalog.lookup("NVIDIA H100 80GB HBM3")      # the name NVML and nvidia-smi print
    model.peak_tflops["bf16"]                           # 989.4
    catalog.mig_profile("1g.10gb").sm_share(7)          # 1/7
    catalog.device_peak_tflops("H100-SXM5-80GB 3g.40gb", "bf16")   # 424.03: a plan's device, MIG share included

Peaks are the vendors' published dense figures (no 2:4 sparsity), tensor-core (matrix-core) rates
where the dtype has them. A dtype missing from `peak_tflops` has no fast path on that GPU (bf16 on
V100). AMD GPUs are listed so that bills and prices compare across vendors; NVML never finds them.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from core.errors import TopologyError

DTYPES = ("fp64", "fp32", "tf32", "bf16", "fp16", "fp8", "int8")
"""Keys of `peak_tflops`; int8 is tera-operations per second."""


@dataclass(frozen=True, slots=True)
class GpuModel:
    key: str
    """Catalog name, e.g. "H100-SXM5-80GB"; stored on each GPU of a topology."""
    nvml_name: str
    """The name NVML gives it ("NVIDIA H100 80GB HBM3"); generated machines use it."""
    name_pattern: str
    """Regular expression matching the names NVML and nvidia-smi print for this model."""
    architecture: str
    compute_capability: str
    sm_count: int
    memory_mib: int
    """Total memory as NVML reports it."""
    memory_gb_per_s: float
    peak_tflops: dict[str, float]
    nvlink_generation: int = 0
    nvlink_links: int = 0
    """NVLinks per GPU; 0 = no NVLink. On PCIe cards, the links of the bridge."""
    pcie_generation: int = 4
    mig_slices: int = 0
    """Compute slices MIG divides the GPU into (7 on A100/H100/H200); 0 = no MIG."""
    mig_profiles: tuple[str, ...] = ()
    vendor: str = "nvidia"

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


_HOPPER_SXM = {"fp64": 67.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9,
               "int8": 1978.9}
_HOPPER_NVL = {"fp64": 60.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0,
               "int8": 1670.0}
_AMPERE_A100 = {"fp64": 19.5, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0}
_H100_80_MIG = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
_H100_94_MIG = ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")
_H200_MIG = ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")
_A100_80_MIG = _H100_80_MIG
_A100_40_MIG = ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")

MODELS: tuple[GpuModel, ...] = (
    GpuModel(key="H100-SXM5-80GB", nvml_name="NVIDIA H100 80GB HBM3", name_pattern=r"H100 80GB HBM3|H100[- ]SXM5?[- ]80GB", architecture="hopper",
             compute_capability="9.0", sm_count=132, memory_mib=81559, memory_gb_per_s=3350.0,
             peak_tflops=_HOPPER_SXM, nvlink_generation=4, nvlink_links=18, pcie_generation=5, mig_slices=7,
             mig_profiles=_H100_80_MIG),
    GpuModel(key="H100-PCIE-80GB", nvml_name="NVIDIA H100 PCIe", name_pattern=r"H100 PCIe|H100-PCIE", architecture="hopper",
             compute_capability="9.0", sm_count=114, memory_mib=81559, memory_gb_per_s=2000.0,
             peak_tflops={"fp64": 51.0, "fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0,
                          "fp8": 1513.0, "int8": 1513.0},
             nvlink_generation=4, nvlink_links=12, pcie_generation=5, mig_slices=7, mig_profiles=_H100_80_MIG),
    GpuModel(key="H100-NVL-94GB", nvml_name="NVIDIA H100 NVL", name_pattern=r"H100 NVL", architecture="hopper", compute_capability="9.0",
             sm_count=132, memory_mib=95830, memory_gb_per_s=3900.0, peak_tflops=_HOPPER_NVL, nvlink_generation=4,
             nvlink_links=12, pcie_generation=5, mig_slices=7, mig_profiles=_H100_94_MIG),
    GpuModel(key="H200-NVL-141GB", nvml_name="NVIDIA H200 NVL", name_pattern=r"H200 NVL", architecture="hopper", compute_capability="9.0",
             sm_count=132, memory_mib=143771, memory_gb_per_s=4800.0, peak_tflops=_HOPPER_NVL, nvlink_generation=4,
             nvlink_links=18, pcie_generation=5, mig_slices=7, mig_profiles=_H200_MIG),
    GpuModel(key="H200-SXM5-141GB", nvml_name="NVIDIA H200", name_pattern=r"H200(?! NVL)", architecture="hopper", compute_capability="9.0",
             sm_count=132, memory_mib=143771, memory_gb_per_s=4800.0, peak_tflops=_HOPPER_SXM, nvlink_generation=4,
             nvlink_links=18, pcie_generation=5, mig_slices=7, mig_profiles=_H200_MIG),
    GpuModel(key="A100-SXM4-80GB", nvml_name="NVIDIA A100-SXM4-80GB", name_pattern=r"A100[- ]SXM4?[- ]80GB", architecture="ampere",
             compute_capability="8.0", sm_count=108, memory_mib=81920, memory_gb_per_s=2039.0,
             peak_tflops=_AMPERE_A100, nvlink_generation=3, nvlink_links=12, mig_slices=7, mig_profiles=_A100_80_MIG),
    GpuModel(key="A100-SXM4-40GB", nvml_name="NVIDIA A100-SXM4-40GB", name_pattern=r"A100[- ]SXM4?[- ]40GB", architecture="ampere",
             compute_capability="8.0", sm_count=108, memory_mib=40960, memory_gb_per_s=1555.0,
             peak_tflops=_AMPERE_A100, nvlink_generation=3, nvlink_links=12, mig_slices=7, mig_profiles=_A100_40_MIG),
    GpuModel(key="A100-PCIE-80GB", nvml_name="NVIDIA A100 80GB PCIe", name_pattern=r"A100 80GB PCIe|A100[- ]PCIE[- ]80GB", architecture="ampere",
             compute_capability="8.0", sm_count=108, memory_mib=81920, memory_gb_per_s=1935.0,
             peak_tflops=_AMPERE_A100, nvlink_generation=3, nvlink_links=12, mig_slices=7, mig_profiles=_A100_80_MIG),
    GpuModel(key="A100-PCIE-40GB", nvml_name="NVIDIA A100-PCIE-40GB", name_pattern=r"A100[- ]PCIE[- ]40GB|A100 40GB PCIe", architecture="ampere",
             compute_capability="8.0", sm_count=108, memory_mib=40960, memory_gb_per_s=1555.0,
             peak_tflops=_AMPERE_A100, nvlink_generation=3, nvlink_links=12, mig_slices=7, mig_profiles=_A100_40_MIG),
    GpuModel(key="L40S", nvml_name="NVIDIA L40S", name_pattern=r"L40S", architecture="ada", compute_capability="8.9", sm_count=142,
             memory_mib=46068, memory_gb_per_s=864.0,
             peak_tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0}),
    # The A10G is AWS's variant of the A10: more CUDA-core FP32, half the A10's tensor rate.
    GpuModel(key="A10G", nvml_name="NVIDIA A10G", name_pattern=r"A10G", architecture="ampere", compute_capability="8.6", sm_count=80,
             memory_mib=23028, memory_gb_per_s=600.0,
             peak_tflops={"fp32": 35.0, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0, "int8": 140.0}),
    GpuModel(key="L4", nvml_name="NVIDIA L4", name_pattern=r"\bL4\b", architecture="ada", compute_capability="8.9", sm_count=58,
             memory_mib=23034, memory_gb_per_s=300.0,
             peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "int8": 242.5}),
    # CDNA3 matrix-core rates from AMD's data sheet; sm_count holds compute units. Its Infinity Fabric
    # (7 links per GPU) is not modelled as an island: the planner sees PCIe peers.
    GpuModel(key="MI300X", nvml_name="AMD Instinct MI300X", name_pattern=r"MI300X", architecture="cdna3",
             compute_capability="", sm_count=304, memory_mib=196608, memory_gb_per_s=5300.0,
             peak_tflops={"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
                          "fp8": 2614.9, "int8": 2614.9},
             pcie_generation=5, vendor="amd"),
    GpuModel(key="V100-SXM2-32GB", nvml_name="Tesla V100-SXM2-32GB", name_pattern=r"V100[- ]SXM2[- ]32GB", architecture="volta",
             compute_capability="7.0", sm_count=80, memory_mib=32768, memory_gb_per_s=900.0,
             peak_tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}, nvlink_generation=2, nvlink_links=6,
             pcie_generation=3),
    GpuModel(key="V100-SXM2-16GB", nvml_name="Tesla V100-SXM2-16GB", name_pattern=r"V100[- ]SXM2[- ]16GB", architecture="volta",
             compute_capability="7.0", sm_count=80, memory_mib=16384, memory_gb_per_s=900.0,
             peak_tflops={"fp64": 7.8, "fp32": 15.7, "fp16": 125.0}, nvlink_generation=2, nvlink_links=6,
             pcie_generation=3),
    GpuModel(key="V100-PCIE-32GB", nvml_name="Tesla V100-PCIE-32GB", name_pattern=r"V100[- ]PCIE[- ]32GB", architecture="volta",
             compute_capability="7.0", sm_count=80, memory_mib=32768, memory_gb_per_s=900.0,
             peak_tflops={"fp64": 7.0, "fp32": 14.0, "fp16": 112.0}, pcie_generation=3),
    GpuModel(key="V100-PCIE-16GB", nvml_name="Tesla V100-PCIE-16GB", name_pattern=r"V100[- ]PCIE[- ]16GB", architecture="volta",
             compute_capability="7.0", sm_count=80, memory_mib=16384, memory_gb_per_s=900.0,
             peak_tflops={"fp64": 7.0, "fp32": 14.0, "fp16": 112.0}, pcie_generation=3),
)

_BY_KEY = {model.key: model for model in MODELS}
_NVLINK_GENERATION_BY_CC_MAJOR = {6: 1, 7: 2, 8: 3, 9: 4, 10: 5}


@functools.cache  # a cluster has a handful of names, asked for once per GPU and per link
def lookup(name: str) -> GpuModel | None:
    """The catalog entry for a GPU name as NVML prints it, or None for a GPU the catalog lacks."""
    return next((model for model in MODELS if re.search(model.name_pattern, name, re.IGNORECASE)), None)


def by_key(key: str) -> GpuModel:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise TopologyError(f"unknown GPU model {key!r}", fix=f"use one of: {', '.join(_BY_KEY)}") from None


def find(key_or_name: str) -> GpuModel | None:
    """The entry for a catalog key ("H100-SXM5-80GB") or an NVML name; None when neither is known."""
    return _BY_KEY.get(key_or_name) or lookup(key_or_name)


def nvlink_generation(model: GpuModel | None, compute_capability: str) -> int:
    """NVLink generation of a GPU: the catalog's, else the one its architecture shipped with."""
    if model is not None and model.nvlink_generation:
        return model.nvlink_generation
    major = int(compute_capability.split(".")[0]) if compute_capability else 0
    return _NVLINK_GENERATION_BY_CC_MAJOR.get(major, 0)


@dataclass(frozen=True, slots=True)
class MigProfile:
    name: str
    """As nvidia-smi prints it: "1g.10gb", "1g.10gb+me", or a compute-instance profile "1c.3g.40gb"."""
    compute_slices: int
    """Slices of the GPU's SMs this profile runs on."""
    memory_gb: int
    """Nominal memory from the name."""

    def sm_share(self, total_slices: int) -> float:
        """Fraction of the parent GPU's SMs (MIG user guide: "Fraction of SMs", e.g. 1/7)."""
        return self.compute_slices / total_slices


_MIG_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.(?P<gb>\d+)gb(?:\+me)?$")


def mig_profile(name: str) -> MigProfile:
    match = _MIG_PROFILE.match(name)
    if match is None:
        raise TopologyError(f"MIG profile {name!r} is not of the form 1g.10gb, 1g.10gb+me or 1c.3g.40gb",
                            fix="copy the profile name exactly as `nvidia-smi -L` prints it")
    slices = int(match["c"] or match["g"])
    return MigProfile(name=name, compute_slices=slices, memory_gb=int(match["gb"]))


def full_gpu_memory_gb(model: GpuModel) -> int:
    """Memory in the name of the model's whole-GPU MIG profile (80 for 7g.80gb)."""
    return mig_profile(model.mig_profiles[-1]).memory_gb


def scaled_peaks(peak_tflops: dict[str, float], share: float) -> dict[str, float]:
    return {dtype: round(value * share, 2) for dtype, value in peak_tflops.items()}


def device_peak_tflops(device_model: str, dtype: str) -> float | None:
    """Dense peak of a plan's device at `dtype`: a catalog key ("A100-SXM4-80GB"), or a key and a MIG
    profile ("H100-SXM5-80GB 1g.10gb"), which gets its share of the GPU's SMs. bf16 falls back to
    fp16 (V100), anything else to fp32. None for a device the catalog lacks."""
    key, _, profile = device_model.partition(" ")
    model = _BY_KEY.get(key)
    if model is None:
        return None
    peaks = model.peak_tflops
    peak = peaks.get(dtype) or (peaks.get("fp16") if dtype == "bf16" else None) or peaks.get("fp32", 0.0)
    return peak * device_share(device_model)


def device_share(device_model: str) -> float:
    """How much of a whole GPU a plan's device is: its SM share for a MIG slice, 1 otherwise."""
    key, _, profile = device_model.partition(" ")
    model = _BY_KEY.get(key)
    if not profile or model is None or not model.mig_slices:
        return 1.0
    return mig_profile(profile).sm_share(model.mig_slices)
