"""What each GPU model can do on paper: dense peak TFLOP/s per dtype, memory, SMs, NVLink, MIG.

    model = catalog.lookup("NVIDIA H100 80GB HBM3")      # the name NVML and nvidia-smi print
    model.peak_tflops["bf16"]                           # 989.4
    catalog.mig_profile("1g.10gb").sm_share(7)          # 1/7
    catalog.device_peak_tflops("H100-SXM5-80GB 3g.40gb", "bf16")   # 424.03: a plan's device, MIG share included

Peaks are the vendors' published dense figures (no 2:4 sparsity), tensor-core (matrix-core) rates
where the dtype has them. A dtype missing from `peak_tflops` has no fast path on that GPU (bf16 on
V100). GeForce cards are given at fp32 accumulation, the rate training runs at. AMD GPUs are listed so
that bills and prices compare across vendors; NVML never finds them. Each entry's comment names the
public source of its figures.
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
    peer_to_peer: bool = True
    """Whether two GPUs of this model copy to each other over PCIe; False for GeForce cards whose driver
    turns it off (NCCL then stages through host memory)."""

    @property
    def memory_gib(self) -> float:
        return self.memory_mib / 1024


# Hopper SXM: NVIDIA H100 Tensor Core GPU Architecture whitepaper (resources.nvidia.com/en-us-tensor-core),
# Table 3, dense with fp32 accumulation; the H200 data sheet (nvidia.com/en-us/data-center/h200) gives the
# H200 the same compute. NVL: the H100 NVL and H200 NVL data sheets, sparse figures halved.
_HOPPER_SXM = {"fp64": 67.0, "fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4, "fp8": 1978.9,
               "int8": 1978.9}
_HOPPER_NVL = {"fp64": 60.0, "fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0, "fp8": 1670.0,
               "int8": 1670.0}
# A100: NVIDIA A100 data sheet (nvidia.com/en-us/data-center/a100), dense; tf32 and int8 at the tensor rate.
_AMPERE_A100 = {"fp64": 19.5, "fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0, "int8": 624.0}
_H100_80_MIG = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")
_H100_94_MIG = ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb")
_H200_MIG = ("1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb")
_A100_80_MIG = _H100_80_MIG
_A100_40_MIG = ("1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb")
_H20_MIG = ("1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.48gb", "4g.48gb", "7g.96gb")
_B200_MIG = ("1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb")
_GB200_MIG = ("1g.23gb", "1g.23gb+me", "1g.47gb", "2g.47gb", "3g.93gb", "4g.93gb", "7g.186gb")
"""B200 and GB200 profiles as the GPU operator's mig-parted configs and `nvidia-smi mig -lgip` print them
(github.com/NVIDIA/mig-parted, config/default-mig-parted-config); H20's as `nvidia-smi -L` lists them."""

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
    # L40S: NVIDIA L40S data sheet (nvidia.com/en-us/data-center/l40s), sparse figures halved.
    GpuModel(key="L40S", nvml_name="NVIDIA L40S", name_pattern=r"L40S", architecture="ada", compute_capability="8.9", sm_count=142,
             memory_mib=46068, memory_gb_per_s=864.0,
             peak_tflops={"fp32": 91.6, "tf32": 183.0, "bf16": 362.05, "fp16": 362.05, "fp8": 733.0, "int8": 733.0}),
    # The A10G is AWS's variant of the A10: more CUDA-core FP32, half the A10's tensor rate. NVIDIA publishes no
    # data sheet for it; figures as baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference tables them.
    GpuModel(key="A10G", nvml_name="NVIDIA A10G", name_pattern=r"A10G", architecture="ampere", compute_capability="8.6", sm_count=80,
             memory_mib=23028, memory_gb_per_s=600.0,
             peak_tflops={"fp32": 35.0, "tf32": 35.0, "bf16": 70.0, "fp16": 70.0, "int8": 140.0}),
    # L4: NVIDIA L4 data sheet (nvidia.com/en-us/data-center/l4), sparse figures halved.
    GpuModel(key="L4", nvml_name="NVIDIA L4", name_pattern=r"\bL4\b", architecture="ada", compute_capability="8.9", sm_count=58,
             memory_mib=23034, memory_gb_per_s=300.0,
             peak_tflops={"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0, "fp8": 242.5, "int8": 242.5}),
    # CDNA3 matrix-core rates from AMD's MI300X data sheet (amd.com/en/products/accelerators/instinct/mi300/
    # mi300x.html); sm_count holds compute units. Its Infinity Fabric
    # (7 links per GPU) is not modelled as an island: the planner sees PCIe peers.
    GpuModel(key="MI300X", nvml_name="AMD Instinct MI300X", name_pattern=r"MI300X", architecture="cdna3",
             compute_capability="", sm_count=304, memory_mib=196608, memory_gb_per_s=5300.0,
             peak_tflops={"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
                          "fp8": 2614.9, "int8": 2614.9},
             pcie_generation=5, vendor="amd"),
    # Blackwell, HGX B200 at 1,000 W: tensor rates (dense) from NVIDIA's HGX B200 data sheet as tabled in
    # github.com/stas00/ml-engineering compute/accelerator/README.md and glennklockwood.com/garden/processors/B200;
    # 148 SMs, 8 TB/s; memory as nvidia-smi prints it on a B200 (183359MiB).
    GpuModel(key="B200-SXM6-180GB", nvml_name="NVIDIA B200", name_pattern=r"(?<!G)B200", architecture="blackwell",
             compute_capability="10.0", sm_count=148, memory_mib=183359, memory_gb_per_s=8000.0,
             peak_tflops={"fp64": 40.0, "fp32": 80.0, "tf32": 1100.0, "bf16": 2250.0, "fp16": 2250.0, "fp8": 4500.0,
                          "int8": 4500.0},
             nvlink_generation=5, nvlink_links=18, pcie_generation=5, mig_slices=7, mig_profiles=_B200_MIG),
    # The B200 of a GB200 superchip (1,200 W): per GPU, the NVL72 rack's figures / 72 (the same two sources;
    # NVIDIA's GB200 NVL72 page: 360 PFLOP/s sparse bf16, 13.4 TB of HBM3e); 186 GB at 8 TB/s, nvidia-smi
    # prints 189471MiB. Grace talks to it over NVLink-C2C; the map sees the GPUs' NVLink (NV18 through the
    # NVLink switch trays) and their PCIe paths. SMs as B200 (NVML reports the live count).
    GpuModel(key="GB200-186GB", nvml_name="NVIDIA GB200", name_pattern=r"GB200", architecture="blackwell",
             compute_capability="10.0", sm_count=148, memory_mib=189471, memory_gb_per_s=8000.0,
             peak_tflops={"fp64": 45.0, "fp32": 90.0, "tf32": 1250.0, "bf16": 2500.0, "fp16": 2500.0, "fp8": 5000.0,
                          "int8": 5000.0},
             nvlink_generation=5, nvlink_links=18, pcie_generation=5, mig_slices=7, mig_profiles=_GB200_MIG),
    # Hopper cut down for export (400-500 W): NVIDIA's H20 product brief, dense: fp8 296, bf16 148, tf32 74, fp32 44,
    # fp64 1 TFLOP/s; 96 GB HBM3 at 4.0 TB/s; NVLink 900 GB/s (huggingface.co/hardware/h20 lists 148 TFLOP/s);
    # 78 SMs as Geekbench reports it; nvidia-smi prints 97871MiB.
    GpuModel(key="H20-96GB", nvml_name="NVIDIA H20", name_pattern=r"\bH20\b", architecture="hopper",
             compute_capability="9.0", sm_count=78, memory_mib=97871, memory_gb_per_s=4000.0,
             peak_tflops={"fp64": 1.0, "fp32": 44.0, "tf32": 74.0, "bf16": 148.0, "fp16": 148.0, "fp8": 296.0,
                          "int8": 296.0},
             nvlink_generation=4, nvlink_links=18, pcie_generation=5, mig_slices=7, mig_profiles=_H20_MIG),
    # GeForce and RTX workstation cards: their vendor's architecture whitepapers, appendix tables. GeForce cards
    # run bf16/fp16 with fp32 accumulation (what training uses) at half their fp16-accumulate rate; those
    # are the figures here. No NVLink on Ada or Blackwell GeForce/RTX cards.
    # RTX 4090: NVIDIA Ada GPU Architecture whitepaper (images.nvidia.com/aem-dam/Solutions/geforce/ada/
    # nvidia-ada-gpu-architecture.pdf), Appendix A: 128 SMs, fp32 82.6, bf16 (fp32 acc.) 165.2, fp8 (fp32
    # acc.) 330.3, int8 660.6, 24 GB GDDR6X at 1,008 GB/s; nvidia-smi prints 24564MiB. NVIDIA's driver
    # has no PCIe peer-to-peer for GeForce 40 (and 50) series cards.
    GpuModel(key="RTX-4090", nvml_name="NVIDIA GeForce RTX 4090", name_pattern=r"RTX 4090(?! D)",
             architecture="ada", compute_capability="8.9", sm_count=128, memory_mib=24564, memory_gb_per_s=1008.0,
             peak_tflops={"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2, "fp8": 330.3, "int8": 660.6},
             peer_to_peer=False),
    # RTX 5090: NVIDIA RTX Blackwell GPU Architecture whitepaper (images.nvidia.com/aem-dam/Solutions/geforce/
    # blackwell/nvidia-rtx-blackwell-gpu-architecture.pdf), Appendix: 170 SMs, fp32 104.8, bf16 (fp32 acc.)
    # 209.5, fp8 (fp32 acc.) 419, int8 838; 32 GB GDDR7 at 1,792 GB/s; nvidia-smi prints 32607MiB.
    GpuModel(key="RTX-5090", nvml_name="NVIDIA GeForce RTX 5090", name_pattern=r"RTX 5090",
             architecture="blackwell", compute_capability="12.0", sm_count=170, memory_mib=32607,
             memory_gb_per_s=1792.0,
             peak_tflops={"fp32": 104.8, "tf32": 104.8, "bf16": 209.5, "fp16": 209.5, "fp8": 419.0, "int8": 838.0},
             pcie_generation=5, peer_to_peer=False),
    # RTX 6000 Ada: the same Ada whitepaper's appendix and NVIDIA's RTX 6000 Ada data sheet (workstation cards
    # accumulate in fp32 at the full rate): 142 SMs, fp32 91.1, tf32 182.1, bf16 364.2, fp8 728.5, int8 728.5;
    # 48 GB GDDR6 at 960 GB/s; nvidia-smi prints 49140MiB.
    GpuModel(key="RTX-6000-Ada", nvml_name="NVIDIA RTX 6000 Ada Generation", name_pattern=r"RTX 6000 Ada",
             architecture="ada", compute_capability="8.9", sm_count=142, memory_mib=49140, memory_gb_per_s=960.0,
             peak_tflops={"fp32": 91.1, "tf32": 182.1, "bf16": 364.2, "fp16": 364.2, "fp8": 728.5, "int8": 728.5}),
    # RTX A6000: NVIDIA Ampere GA102 GPU Architecture whitepaper, Appendix A, and the RTX A6000 data sheet
    # (nvidia.com/en-us/design-visualization/rtx-a6000): 84 SMs, fp32 38.7, tf32 77.4, bf16 154.8, int8 309.7;
    # 48 GB GDDR6 at 768 GB/s; a two-card NVLink bridge (112.5 GB/s both ways, NV4 in `nvidia-smi topo -m`);
    # nvidia-smi prints 49140MiB.
    GpuModel(key="RTX-A6000", nvml_name="NVIDIA RTX A6000", name_pattern=r"RTX A6000", architecture="ampere",
             compute_capability="8.6", sm_count=84, memory_mib=49140, memory_gb_per_s=768.0,
             peak_tflops={"fp32": 38.7, "tf32": 77.4, "bf16": 154.8, "fp16": 154.8, "int8": 309.7},
             nvlink_generation=3, nvlink_links=4),
    # A10: NVIDIA A10 data sheet (nvidia.com/en-us/data-center/products/a10-gpu): fp32 31.2, tf32 62.5, bf16 125,
    # int8 250 (dense); 72 SMs; 24 GB GDDR6 at 600 GB/s; nvidia-smi prints 23028MiB.
    GpuModel(key="A10", nvml_name="NVIDIA A10", name_pattern=r"\bA10\b", architecture="ampere",
             compute_capability="8.6", sm_count=72, memory_mib=23028, memory_gb_per_s=600.0,
             peak_tflops={"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0, "int8": 250.0}),
    # MI325X: AMD's MI325X data sheet (amd.com/en/products/accelerators/instinct/mi300/mi325x.html): the MI300X's
    # CDNA3 compute (304 CUs, bf16 1,307.4, fp8 2,614.9 dense) with 256 GB HBM3E at 6 TB/s.
    GpuModel(key="MI325X", nvml_name="AMD Instinct MI325X", name_pattern=r"MI325X", architecture="cdna3",
             compute_capability="", sm_count=304, memory_mib=262144, memory_gb_per_s=6000.0,
             peak_tflops={"fp64": 163.4, "fp32": 163.4, "tf32": 653.7, "bf16": 1307.4, "fp16": 1307.4,
                          "fp8": 2614.9, "int8": 2614.9},
             pcie_generation=5, vendor="amd"),
    # GTX 1080 Ti (Pascal, 2017): NVIDIA's GeForce GTX 1080 Ti specifications, fp32 11.34 TFLOP/s at boost;
    # no tensor cores, fp16 at 1/64 of fp32, so no fast 16-bit path: bf16 jobs are costed at fp32.
    # 28 SMs, 11 GB GDDR5X at 484 GB/s; nvidia-smi prints 11264MiB.
    GpuModel(key="GTX-1080-Ti", nvml_name="NVIDIA GeForce GTX 1080 Ti", name_pattern=r"GTX 1080 Ti",
             architecture="pascal", compute_capability="6.1", sm_count=28, memory_mib=11264, memory_gb_per_s=484.0,
             peak_tflops={"fp64": 0.35, "fp32": 11.34}, pcie_generation=3),
    # Volta: NVIDIA V100 data sheet (images.nvidia.com/content/technologies/volta/pdf/volta-v100-datasheet-
    # update-us-1165301-r5.pdf): SXM2 7.8 / 15.7 / 125 tensor, PCIe 7 / 14 / 112; no bf16.
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


def peak_at(peak_tflops: dict[str, float], dtype: str) -> float:
    """The dense peak a job training in `dtype` gets: bf16 falls back to fp16 (V100), anything else to
    fp32 (GPUs without tensor cores); 0 for no figures."""
    return peak_tflops.get(dtype) or (peak_tflops.get("fp16") if dtype == "bf16" else None) \
        or peak_tflops.get("fp32", 0.0)


def device_peak_tflops(device_model: str, dtype: str) -> float | None:
    """Dense peak of a plan's device at `dtype`: a catalog key ("A100-SXM4-80GB"), or a key and a MIG
    profile ("H100-SXM5-80GB 1g.10gb"), which gets its share of the GPU's SMs (see peak_at for the
    fallbacks). None for a device the catalog lacks."""
    key, _, profile = device_model.partition(" ")
    model = _BY_KEY.get(key)
    if model is None:
        return None
    return peak_at(model.peak_tflops, dtype) * device_share(device_model)


def device_share(device_model: str) -> float:
    """How much of a whole GPU a plan's device is: its SM share for a MIG slice, 1 otherwise."""
    key, _, profile = device_model.partition(" ")
    model = _BY_KEY.get(key)
    if not profile or model is None or not model.mig_slices:
        return 1.0
    return mig_profile(profile).sm_share(model.mig_slices)
