"""Triton kernel for kernels.adamw: AdamW on fp32 masters from bf16 gradients, writing bf16 weights, or
from fp32 gradients, writing nothing else (FROM_BF16, a constant the kernel is compiled for).

Imported only when CUDA masters arrive (kernels.adamw imports it lazily; tests run it on CPU tensors in
Triton's interpreter). One launch steps every
parameter (the 1.3B GPT of benchmarks/step.py has 147 tensors, 49 of them norm gains and biases
too small to fill a launch of their own). Each program steps CHUNK elements of one tensor, found
through two tables on the GPU:
  tensors   a row per tensor: the addresses of its master, gradient, exp_avg, exp_avg_sq and
            bf16 weight (0 without one), its element count and its param group (int64)
  chunks    a row per program: (tensor, chunk of that tensor) (int32)
A third holds each group's lr, betas, eps and weight decay, in fp32 as the fused kernel takes
them; a fourth, each tensor's beta1 ** step and beta2 ** step, made on the GPU by torch's pow
before the launch from an uploaded table of each tensor's betas (adamw_step says why torch's).

The tables are uploaded from pinned memory without waiting for the GPU, and only when they change.
Masters, moments, step counts and weights keep their addresses; so do the gradients under DDP
(views into its buckets, once it has rebuilt them after the first step), while without DDP each backward makes new ones and the tensor table is
uploaded again (~8 KB for the 1.3B GPT). lr changes at most steps, so the group table does too.

A chunk that lies wholly inside its tensor is stepped with unmasked loads and stores, which Triton
makes 16 bytes wide where every address is a multiple of 16 (ALIGNED, checked on the host; a
tensor table address carries no alignment Triton can see); the tail chunk of a tensor is masked.
Until 2026-12-05 the hint sat on the int64 address, and the cast to a pointer dropped it: the kernel
ADAMW_TUNING was measured with made 4-byte accesses only (tests/unit/test_adamw_ptx.py now reads
the PTX Triton makes for sm_90).
The arithmetic is kernels.adamw's docstring's: libdevice's correctly rounded division and square
root, as nvcc compiles the fused kernel's `/` and std::sqrt (Triton's own fp32 `/` and sqrt are
approximate), and tl.fma where that kernel has a fused multiply-add.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_FIELDS = tl.constexpr(7)
"""int64 fields in a row of the tensor table."""
_HYPER = tl.constexpr(5)
"""fp32 fields in a row of the group table: lr, beta1, beta2, eps, weight_decay."""


@dataclass(frozen=True, slots=True)
class AdamWTuning:
    chunk: int
    """Elements of one tensor a program steps."""
    block: int
    """Elements loaded at a time."""
    warps: int


ADAMW_TUNING = AdamWTuning(chunk=8192, block=2048, warps=8)
"""Measured on an H200 over the 1.3B GPT's 147 tensors (36.8 GB moved), with 4-byte accesses (the
alignment hint was lost then; to be measured again with 16-byte ones): 9.45 and 9.59 ms in two runs
(3.9 TB/s; a plain copy of as many bytes took 8.54 ms, 4.31 TB/s). Chunks of 4096 with blocks of
1024 and 4 warps took 9.48, of 8192 with 1024 and 4 9.84, of 16384 9.90 to 10.37, of 65536 10.30
to 10.98; blocks of 512 10.91."""


@triton.jit
def _pointer(row, field: tl.constexpr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    pointer = tl.load(row + field).to(tl.pointer_type(dtype))
    if ALIGNED:  # on the pointer: a hint on the int64 address is lost in the cast (no 16-byte accesses)
        pointer = tl.multiple_of(pointer, 16)
    return pointer


@triton.jit
def _step_block(master, grad, exp_avg, exp_avg_sq, copy, offsets, mask, grad_scale, lr, beta1, beta2, eps,
                weight_decay, step_size, bias_correction2_sqrt, HAS_SCALE: tl.constexpr, FROM_BF16: tl.constexpr):
    g = tl.load(grad + offsets, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = libdevice.div_rn(g, grad_scale)
    p = tl.load(master + offsets, mask=mask)
    if weight_decay != 0.0:
        p = tl.fma(-(lr * weight_decay), p, p)
    m = tl.fma(beta1, tl.load(exp_avg + offsets, mask=mask), tl.fma(-beta1, g, g))
    square = g * g
    v = tl.fma(beta2, tl.load(exp_avg_sq + offsets, mask=mask), tl.fma(-beta2, square, square))
    denom = libdevice.div_rn(libdevice.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - libdevice.div_rn(step_size * m, denom)
    tl.store(master + offsets, p, mask=mask)
    tl.store(exp_avg + offsets, m, mask=mask)
    tl.store(exp_avg_sq + offsets, v, mask=mask)
    if FROM_BF16:
        tl.store(copy + offsets, p.to(tl.bfloat16), mask=mask)


@triton.jit
def _adamw_kernel(tensors_ptr, chunks_ptr, hyper_ptr, powers_ptr, grad_scale_ptr, HAS_SCALE: tl.constexpr,
                  FROM_BF16: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    program = tl.program_id(0)
    tensor = tl.load(chunks_ptr + 2 * program).to(tl.int64)
    row = tensors_ptr + tensor * _FIELDS
    start = tl.load(chunks_ptr + 2 * program + 1).to(tl.int64) * CHUNK
    master = _pointer(row, 0, tl.float32, ALIGNED)
    exp_avg = _pointer(row, 2, tl.float32, ALIGNED)
    exp_avg_sq = _pointer(row, 3, tl.float32, ALIGNED)
    if FROM_BF16:
        grad = _pointer(row, 1, tl.bfloat16, ALIGNED)
        copy = _pointer(row, 4, tl.bfloat16, ALIGNED)
    else:
        grad = _pointer(row, 1, tl.float32, ALIGNED)
        copy = master  # not written: no copy
    numel = tl.load(row + 5)
    hyper = hyper_ptr + tl.load(row + 6) * _HYPER
    lr, beta1, beta2 = tl.load(hyper), tl.load(hyper + 1), tl.load(hyper + 2)
    eps, weight_decay = tl.load(hyper + 3), tl.load(hyper + 4)
    bias_correction2_sqrt = libdevice.sqrt_rn(1.0 - tl.load(powers_ptr + 2 * tensor + 1))
    step_size = libdevice.div_rn(lr, 1.0 - tl.load(powers_ptr + 2 * tensor))
    grad_scale = 1.0
    if HAS_SCALE:
        grad_scale = tl.load(grad_scale_ptr).to(tl.float32)
    if start + CHUNK <= numel:
        for offset in range(0, CHUNK, BLOCK):
            offsets = tl.multiple_of(start + offset, BLOCK) + tl.arange(0, BLOCK)
            _step_block(master, grad, exp_avg, exp_avg_sq, copy, offsets, None, grad_scale, lr, beta1, beta2, eps,
                        weight_decay, step_size, bias_correction2_sqrt, HAS_SCALE, FROM_BF16)
    else:
        for offset in range(0, CHUNK, BLOCK):
            offsets = start + offset + tl.arange(0, BLOCK)
            _step_block(master, grad, exp_avg, exp_avg_sq, copy, offsets, offsets < numel, grad_scale, lr, beta1,
                        beta2, eps, weight_decay, step_size, bias_correction2_sqrt, HAS_SCALE, FROM_BF16)


class DeviceTables:
    """The kernel's tables on the GPU, each uploaded again only when its values change."""

    def __init__(self):
        self._uploaded: dict[str, tuple[object, torch.Tensor]] = {}

    def get(self, name: str, key: object, values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The table `name` for `key`; values() makes its rows when the key is new."""
        held = self._uploaded.get(name)
        if held is None or held[0] != key:
            # Pinned, so the copy need not wait for the GPU; torch's pinned-memory cache reuses the
            # buffer only once the copy has run. (CPU tensors: the kernel run by Triton's interpreter.)
            host = torch.tensor(values(), dtype=dtype, pin_memory=device.type == "cuda")
            held = key, host.to(device, non_blocking=True)
            self._uploaded[name] = held
        return held[1]


def adamw_step(tables: DeviceTables, tensors: list, hyper: list, grad_scale: torch.Tensor | None) -> None:
    """Steps `tensors` (kernels.adamw.AdamWTensors; their step counts advance once they are checked)
    with the settings of their groups (`hyper`, kernels.adamw.AdamWHyper per group), gradients divided
    by grad_scale if given: from bf16 gradients writing bf16 copies, or from fp32 ones writing none."""
    device = tensors[0].master.device
    has_copy = tensors[0].copy is not None
    rows = [_row(t, device, has_copy) for t in tensors]
    torch._foreach_add_([t.step for t in tensors], 1)  # each step count, as fused AdamW advances it
    numels = tuple(t.master.numel() for t in tensors)
    chunk = ADAMW_TUNING.chunk
    tensor_table = tables.get("tensors", rows, lambda: rows, torch.int64, device)
    chunk_table = tables.get("chunks", numels, lambda: _chunks(numels, chunk), torch.int32, device)
    hyper_table = tables.get("hyper", hyper, lambda: hyper, torch.float32, device)
    betas = [(hyper[t.group].beta1, hyper[t.group].beta2) for t in tensors]
    beta_table = tables.get("betas", betas, lambda: betas, torch.float32, device)
    # beta1 ** step and beta2 ** step per tensor by torch's own CUDA pow, whose powf is the fused
    # kernel's (the same at::native::pow_, built by the same nvcc). On an H200, libdevice's powf as
    # Triton links it differed from that at 90 % of the steps up to 1000, fp64 pow rounded at 7 %.
    powers = torch.pow(beta_table, torch.stack([t.step for t in tensors])[:, None])
    aligned = all(row[field] % 16 == 0 for row in rows for field in range(5 if has_copy else 4))
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _adamw_kernel[(len(chunk_table),)](
            tensor_table, chunk_table, hyper_table, powers, grad_scale if grad_scale is not None else hyper_table,
            HAS_SCALE=grad_scale is not None, FROM_BF16=has_copy, ALIGNED=aligned, CHUNK=chunk,
            BLOCK=ADAMW_TUNING.block, num_warps=ADAMW_TUNING.warps)


def _row(t, device: torch.device, has_copy: bool) -> tuple[int, ...]:
    """The tensor table's row for one parameter, after checking what the kernel assumes of it: with a
    copy, a bf16 gradient and copy; without, an fp32 gradient."""
    if (t.copy is not None) != has_copy:
        raise ValueError("either every parameter of a step has a bf16 copy or none has")
    expected = [("master", t.master, torch.float32),
                ("gradient", t.grad, torch.bfloat16 if has_copy else torch.float32),
                ("exp_avg", t.exp_avg, torch.float32), ("exp_avg_sq", t.exp_avg_sq, torch.float32)]
    if has_copy:
        expected.append(("copy", t.copy, torch.bfloat16))
    for name, tensor, dtype in expected:
        if tensor.dtype != dtype or tensor.device != device or not tensor.is_contiguous() \
                or tensor.numel() != t.master.numel():
            raise ValueError(f"the {name} of a {tuple(t.master.shape)} master is {tensor.dtype} "
                             f"{tuple(tensor.shape)} on {tensor.device}"
                             f"{'' if tensor.is_contiguous() else ', not contiguous'}: the kernel takes "
                             f"a contiguous {dtype} tensor of the master's size on {device}")
    if t.step.device != device or t.step.dtype != torch.float32:
        raise ValueError(f"the step count is {t.step.dtype} on {t.step.device}: the kernel takes it in fp32 "
                         f"on {device}, where torch's AdamW keeps it with fused=True")
    return (t.master.data_ptr(), t.grad.data_ptr(), t.exp_avg.data_ptr(), t.exp_avg_sq.data_ptr(),
            t.copy.data_ptr() if has_copy else 0, t.master.numel(), t.group)


def _chunks(numels: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
    """(tensor, chunk) for every chunk of every tensor."""
    return [(i, c) for i, n in enumerate(numels) for c in range(-(-n // chunk))]
