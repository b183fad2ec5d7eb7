"""The micro-benchmark behind a node's measured device figures: what its devices really do.

    python3 -m topology.device_bench                  # this machine's CPUs and GPUs, as a table
    python3 -m topology.device_bench --json           # the same as JSON (what the probe reads)
    python3 -m topology.device_bench --seconds 1.0    # longer per figure: steadier numbers

Per device model (the first GPU of each name; MIG devices are left out: a slice is its parent's
share) and for the CPUs: dense matrix products at a training shape in bf16, float8 (where the GPU
has it) and fp32, a copy far larger than the caches, host↔device copies from pinned memory, and a
copy to a second GPU of the same model. The CPUs also train a small transformer block
(REFERENCE_BLOCK): a CPU worker's step is small matrices, attention and elementwise work, whose
share of the product rate is the CPU's own (a share fitted on one CPU model missed another's step
by 2x), so CPU workers are planned at the block's rate. Each figure is the best of a few timed rounds: the probe
runs while Ray starts its workers, and a core taken away for a moment should not lower the figure
for good. CPU rates are per core, measured with every core of the process's affinity at work, one
thread each, as CPU workers run them.

The probe runs this in a child process (topology/device_figures.py): a CUDA context would otherwise
stay in the Ray worker that probed, holding GPU memory that training needs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from topology.cluster import MeasuredDevice

GPU_MATMUL_SIZE = 8192
"""M = N = K of the GPU products: a large training GEMM; on an H200 it runs at 769–798 TFLOP/s in bf16."""
CPU_MATMUL_SIZE = 1024
"""The CPU products' size: 2 GFLOP, tens of milliseconds a core."""
GPU_COPY_BYTES = 512 * 2**20
"""Copied device to device: ten times an H200's L2."""
CPU_COPY_BYTES = 256 * 2**20
"""Copied in host memory: beyond every L3 of 2026's servers but the largest."""
TRANSFER_BYTES = 256 * 2**20
"""Host↔device and peer copies."""
ROUNDS = 5
"""Timed rounds per figure; the best counts."""


@dataclass(frozen=True, slots=True)
class BlockShape:
    width: int
    heads: int
    seq_len: int
    batch: int


REFERENCE_BLOCK = BlockShape(width=128, heads=4, seq_len=128, batch=16)
"""The block CPU figures train: a pre-norm GPT block (causal attention, 4x GELU MLP, no biases) at the
scale CPU workers train, examples/cpu-tiny.toml's blocks at one worker's micro-batch of 16 sequences:
2.8 GFLOP a pass, about 50 ms on a core of this project's AMD EPYC."""


@dataclass(frozen=True, slots=True)
class Clock:
    """Times work on one device: CUDA events on a GPU, the wall clock on the CPU."""

    device: torch.device

    def seconds(self, work: Callable[[], object], repeats: int) -> float:
        """Seconds per call of `work`, `repeats` calls back to back, after the device is idle."""
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # the events go on this device's stream
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(repeats):
                    work()
                end.record()
                end.synchronize()
                return start.elapsed_time(end) / 1e3 / repeats
        begin = time.perf_counter()
        for _ in range(repeats):
            work()
        return (time.perf_counter() - begin) / repeats


def best_rate(clock: Clock, work: Callable[[], object], amount: float, seconds: float) -> float:
    """The highest `amount` per second over ROUNDS rounds sized to take about `seconds` together."""
    single = clock.seconds(work, 1)  # also the warm-up: kernels chosen, caches filled
    repeats = max(1, int(seconds / ROUNDS / max(single, 1e-6)))
    return max(amount / clock.seconds(work, repeats) for _ in range(ROUNDS))


def matmul_tflops(device: torch.device, dtype: torch.dtype, size: int, seconds: float) -> float:
    """Dense (size × size) @ (size × size) products per second, in TFLOP/s."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(dtype)
    b = torch.randn(size, size, device=device, generator=generator).to(dtype)
    return best_rate(Clock(device), lambda: a @ b, 2 * size**3, seconds) / 1e12


def fp8_matmul_tflops(device: torch.device, size: int, seconds: float) -> float:
    """float8 (e4m3) products through torch._scaled_mm, as torchao's float8 training runs them."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=device, generator=generator).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device)
    return best_rate(Clock(device), lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16),
                     2 * size**3, seconds) / 1e12


def reference_block(shape: BlockShape, device: torch.device | str) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """torch's own pre-norm encoder layer made a GPT block (workers/models/gpt.py's: tanh GELU, no biases,
    causal attention through scaled_dot_product_attention), its input and its causal mask."""
    with torch.device(device):
        torch.manual_seed(0)
        block = nn.TransformerEncoderLayer(shape.width, shape.heads, 4 * shape.width, dropout=0.0, bias=False,
                                           activation=functools.partial(F.gelu, approximate="tanh"),
                                           batch_first=True, norm_first=True)
        x = torch.randn(shape.batch, shape.seq_len, shape.width, requires_grad=True)
        mask = nn.Transformer.generate_square_subsequent_mask(shape.seq_len)
    return block, x, mask


def block_training_flops(shape: BlockShape) -> float:
    """One forward and backward of the block, counted on the meta device as planning/model_size.py counts
    a model (attention in full), so a rate in these FLOPs prices a model's counted FLOPs."""
    block, x, mask = reference_block(shape, "meta")
    with FlopCounterMode(display=False) as counter:
        block(x, src_mask=mask, is_causal=True).sum().backward()
    return float(counter.get_total_flops())


def block_training_tflops(shape: BlockShape, seconds: float) -> float:
    """The reference block trained (forward and backward, no optimizer) on the CPU, in counted TFLOP/s."""
    block, x, mask = reference_block(shape, "cpu")
    return best_rate(Clock(torch.device("cpu")), lambda: block(x, src_mask=mask, is_causal=True).sum().backward(),
                     block_training_flops(shape), seconds) / 1e12


def copy_gb_per_s(source: torch.device, target: torch.device, nbytes: int, seconds: float, *,
                  pinned: bool = False, count_both_ends: bool = False) -> float:
    """A copy of `nbytes` from `source` to `target`; count_both_ends counts bytes read and written
    (memory bandwidth), otherwise the bytes moved (a link)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=source, pin_memory=pinned and source.type == "cpu")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=target, pin_memory=pinned and target.type == "cpu")
    src.fill_(1)
    clock = Clock(source if source.type == "cuda" else target)
    moved = nbytes * (2 if count_both_ends else 1)
    return best_rate(clock, lambda: dst.copy_(src, non_blocking=True), moved, seconds) / 1e9


def measure_cpu(seconds: float) -> MeasuredDevice:
    """The CPUs of this process's affinity, every one at work as CPU workers use them: one thread per
    core, each on its own data; rates per core (the median core's)."""
    cores, threads = len(os.sched_getaffinity(0)), torch.get_num_threads()
    cpu, begin = torch.device("cpu"), time.perf_counter()
    torch.set_num_threads(1)
    try:
        return MeasuredDevice(
            name="cpu", cores=cores,
            fp32_tflops=round(on_every_core(cores, lambda: matmul_tflops(cpu, torch.float32, CPU_MATMUL_SIZE,
                                                                         seconds)), 5),
            bf16_tflops=round(on_every_core(cores, lambda: matmul_tflops(cpu, torch.bfloat16, CPU_MATMUL_SIZE,
                                                                         seconds)), 5),
            fp32_block_tflops=round(on_every_core(cores, lambda: block_training_tflops(REFERENCE_BLOCK, seconds)), 5),
            memory_gb_per_s=round(on_every_core(cores, lambda: copy_gb_per_s(cpu, cpu, CPU_COPY_BYTES // cores, seconds,
                                                                             count_both_ends=True)), 2),
            seconds=round(time.perf_counter() - begin, 2))
    finally:
        torch.set_num_threads(threads)


def on_every_core(cores: int, measure: Callable[[], float]) -> float:
    """`measure` in `cores` threads at once (torch releases the GIL in its kernels), the median result.
    Independent threads, not one product split over the cores: a core taken away for a moment slows
    its own thread, not every thread waiting for it at the product's end."""
    results: list[float] = [0.0] * cores

    def run(i: int) -> None:
        results[i] = measure()
    workers = [threading.Thread(target=run, args=(i,)) for i in range(cores)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return statistics.median(results)


def measure_gpu(index: int, peer: int | None, seconds: float, notes: list[str]) -> MeasuredDevice:
    """GPU `index`, and copies to GPU `peer` (another of the same model) when there is one."""
    device, host = torch.device("cuda", index), torch.device("cpu")
    name = torch.cuda.get_device_name(index)
    torch.cuda.set_device(device)  # a peer copy is issued from this GPU's stream
    begin = time.perf_counter()
    figures = MeasuredDevice(
        name=name,
        bf16_tflops=round(matmul_tflops(device, torch.bfloat16, GPU_MATMUL_SIZE, seconds), 1),
        fp32_tflops=round(matmul_tflops(device, torch.float32, GPU_MATMUL_SIZE, seconds), 1),
        memory_gb_per_s=round(copy_gb_per_s(device, device, GPU_COPY_BYTES, seconds, count_both_ends=True), 1),
        host_to_device_gb_per_s=round(copy_gb_per_s(host, device, TRANSFER_BYTES, seconds, pinned=True), 1),
        device_to_host_gb_per_s=round(copy_gb_per_s(device, host, TRANSFER_BYTES, seconds, pinned=True), 1))
    if torch.cuda.get_device_capability(index) >= (8, 9):
        try:
            figures.fp8_tflops = round(fp8_matmul_tflops(device, GPU_MATMUL_SIZE, seconds), 1)
        except RuntimeError as e:  # a torch build without float8 kernels for this GPU
            notes.append(f"{name}: no float8 figure ({str(e).splitlines()[0][:120]})")
    if peer is not None:
        figures.peer_gb_per_s = round(copy_gb_per_s(device, torch.device("cuda", peer), TRANSFER_BYTES, seconds), 1)
    figures.seconds = round(time.perf_counter() - begin, 2)
    return figures


def gpus_to_measure(names: list[str]) -> list[tuple[int, int | None]]:
    """(index, peer index or None) for the first whole GPU of each name; MIG devices are left out."""
    chosen: dict[str, list[int]] = {}
    for index, name in enumerate(names):
        if " MIG " not in f"{name} ":
            chosen.setdefault(name, []).append(index)
    return [(indices[0], indices[1] if len(indices) > 1 else None) for indices in chosen.values()]


def measure_all(seconds: float) -> dict:
    """Every device model of this machine and its CPUs: {"devices": [...], "notes": [...], "torch": version}."""
    notes: list[str] = []
    devices = [measure_cpu(seconds)]
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        for index, peer in gpus_to_measure(names):
            try:
                devices.append(measure_gpu(index, peer, seconds, notes))
            except (RuntimeError, torch.cuda.OutOfMemoryError) as e:  # busy, or too small a GPU
                notes.append(f"{names[index]} not measured: {str(e).splitlines()[0][:160]}")
    return {"devices": [asdict(d) for d in devices], "notes": notes, "torch": torch.__version__}


def _table(result: dict) -> str:
    columns = ("name", "bf16_tflops", "fp8_tflops", "fp32_tflops", "fp32_block_tflops", "memory_gb_per_s", "host_to_device_gb_per_s",
               "device_to_host_gb_per_s", "peer_gb_per_s", "cores", "seconds")
    lines = ["\t".join(columns)]
    lines += ["\t".join(str(device[c]) for c in columns) for device in result["devices"]]
    return "\n".join(lines + [f"note: {note}" for note in result["notes"]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.3, help="time spent on each figure (default 0.3)")
    parser.add_argument("--json", action="store_true", help="print JSON (rates per device; CPUs per core)")
    args = parser.parse_args(argv)
    result = measure_all(args.seconds)
    print(json.dumps(result) if args.json else _table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
