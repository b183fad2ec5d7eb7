"""Gradient compression for comm hooks: top-k by magnitude, error feedback, int8 codes.

How a sparse all-reduce uses it, per bucket and step:

    residual = torch.zeros(bucket.numel(), dtype=torch.float32, device=bucket.device)  # once
    mine = compress(bucket, residual, k_ratio=0.01)   # residual now holds all that was not sent
    rows = all_gather(mine.payload)                   # every rank's payload has the same size
    decompress_sum(bucket, rows.view(world_size, -1), mine, world_size)   # fp32 bucket: the average, written once
    # or, row by row into an fp32 sum:  decompress_accumulate(total, mine.with_payload(row))

CUDA tensors run the Triton kernels (kernels/triton_kernels.py), anything else the torch twins
(kernels/reference.py); both give the same payload bytes. On CUDA, compress and top-k are a
memset and one kernel launch, decompress_sum one launch; compress takes 4 bytes of scratch per
element from torch's allocator for its duration. A hook can capture compress(bucket, residual,
k_ratio, check_finite=False) per bucket in a CUDA graph, since DDP's bucket and the residual
are persistent tensors. What holds for every call:

- Error feedback loses nothing: with acc = bucket (as fp32) + residual_before, computed in fp32,
  residual_after + dequantised == acc exactly, element by element, where dequantised is what
  decompress_accumulate adds to zeros. (Each sent value is code * scale rounded to fp32, and
  acc - that is exact because the two are within a factor of two; ranges where fp32 is
  subnormal, below ~1e-38, are outside this promise.)
- Quantisation: a block's scale is its largest selected |acc| / 127; every sent entry's
  |acc - code * scale| is at most scale * (1/2 + 2**-16) (the code is acc times the block's
  correctly rounded reciprocal, rounded half-even). Entries whose code rounds to 0 are not sent
  and stay in the residual.
- Count: about k = k_ratio * numel entries, within the tolerance documented in kernels.selection;
  at most `capacity`, and any excess stays in the residual.
- NaN or inf in bucket or residual raises NonFiniteGradientError (from compress at once, or from
  raise_if_nonfinite() on any rank's payload when the check is deferred).
"""

from __future__ import annotations

from types import ModuleType

import torch

from core.errors import NonFiniteGradientError
from kernels import reference
from kernels.backend import use_triton
from kernels.payload import CompressedBucket, PayloadLayout, allocate
from kernels.selection import SelectionPlan, check_k_ratio

DEFAULT_BLOCK = 1024
"""Elements per scale. At k = 1 % about 10 entries (50 bytes) share a 4-byte scale, 7 % of the
payload; block=4096 cuts that to 2 % but compresses about a fifth slower on an H200 (a block
is one program's tile, and larger tiles fit fewer programs per multiprocessor)."""

MIN_BLOCK, MAX_BLOCK = 128, 8192

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compress(bucket: torch.Tensor, residual: torch.Tensor, k_ratio: float, block: int = DEFAULT_BLOCK, *,
             check_finite: bool = True) -> CompressedBucket:
    """Select about k_ratio of bucket + residual by magnitude, quantise it to int8 with one scale
    per `block` elements, and leave everything not sent in `residual` (updated in place).

    check_finite=True waits for the device once to raise NonFiniteGradientError on NaN/inf; a
    comm hook that must not wait passes False and calls raise_if_nonfinite() on the gathered
    payloads later, which also tells every rank that some rank's bucket was poisoned.
    """
    flat = _flat(bucket, "bucket")
    _check_residual(flat, residual)
    if not (isinstance(block, int) and MIN_BLOCK <= block <= MAX_BLOCK and block & (block - 1) == 0):
        raise ValueError(f"block must be a power of two from {MIN_BLOCK} to {MAX_BLOCK}, got {block!r}; "
                         f"{DEFAULT_BLOCK} is the default")
    plan, layout = _plan_and_layout(flat.numel(), k_ratio, block)
    out, workspace = allocate(layout, plan, flat.device)
    if plan:
        _backend(flat).select(flat, residual, plan, out, workspace)
    if check_finite:
        out.raise_if_nonfinite()
    return out


def payload_layout(numel: int, k_ratio: float, block: int = DEFAULT_BLOCK) -> PayloadLayout:
    """The layout compress() gives a bucket of `numel` elements: what its payload will hold, known
    before any gradient exists (the planner costs the wire with it)."""
    return _plan_and_layout(numel, k_ratio, block)[1]


def _plan_and_layout(numel: int, k_ratio: float, block: int) -> tuple[SelectionPlan | None, PayloadLayout]:
    check_k_ratio(k_ratio)
    plan = SelectionPlan.for_ratio(numel, k_ratio) if numel else None
    return plan, PayloadLayout(numel, plan.capacity if plan else 0, torch.int8, block)


def decompress_accumulate(dense_out: torch.Tensor, compressed: CompressedBucket) -> None:
    """dense_out[index] += code * scale for each valid entry of one payload, in place.

    dense_out is float32 so that the sum over many ranks keeps fp32 precision; apply each rank's
    payload with its own call (entries of one payload never collide, so no atomics are needed
    and the sum is deterministic).
    """
    if compressed.layout.block is None:
        raise ValueError("decompress_accumulate needs a payload from compress(); top-k selections carry raw values")
    if (dense_out.dtype != torch.float32 or not dense_out.is_contiguous() or dense_out.numel() != compressed.numel
            or dense_out.device != compressed.payload.device):
        raise ValueError(f"dense_out must be a contiguous float32 tensor of {compressed.numel} elements on "
                         f"{compressed.payload.device}, got {dense_out.dtype} {tuple(dense_out.shape)} on "
                         f"{dense_out.device}; accumulate into an fp32 buffer and cast afterwards")
    if compressed.capacity:
        _backend(dense_out).decompress_accumulate(dense_out.view(-1), compressed)


def decompress_sum(dense_out: torch.Tensor, payloads: torch.Tensor, like: CompressedBucket, divisor: float = 1.0) -> None:
    """dense_out = (sum of every row's dequantised payload) / divisor: a whole all-gather at once.

    `payloads` is the (ranks, nbytes) uint8 result of all-gathering payloads made like `like`
    (same bucket size, k_ratio and block). Each element of dense_out is written once, with the
    rows added in order in fp32 and the sum divided (correctly rounded) by `divisor`; unlike
    zeroing a buffer, decompress_accumulate per row and dividing, no pass over the bucket but
    the final write touches memory, whatever the number of ranks.
    """
    layout = like.layout
    if layout.block is None:
        raise ValueError("decompress_sum needs payloads from compress(); top-k selections carry raw values")
    if (payloads.dtype != torch.uint8 or payloads.dim() != 2 or not payloads.is_contiguous()
            or payloads.shape[1] != layout.nbytes or payloads.device != dense_out.device):
        raise ValueError(f"payloads must be a contiguous (ranks, {layout.nbytes}) uint8 tensor on {dense_out.device}, "
                         f"got {payloads.dtype} {tuple(payloads.shape)} on {payloads.device}; pass the all-gathered "
                         "buffer viewed as (world_size, -1)")
    if dense_out.dtype != torch.float32 or not dense_out.is_contiguous() or dense_out.numel() != layout.numel:
        raise ValueError(f"dense_out must be a contiguous float32 tensor of {layout.numel} elements, got "
                         f"{dense_out.dtype} {tuple(dense_out.shape)}; sum into an fp32 buffer and cast afterwards")
    if not divisor > 0:
        raise ValueError(f"divisor must be positive, got {divisor!r}; pass the world size to average")
    if layout.capacity:
        _backend(dense_out).decompress_sum(dense_out.view(-1), payloads, layout, divisor)
    else:
        dense_out.zero_()


def topk_by_magnitude(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int32 indices, values) of about k elements of x with the largest |x|, indices ascending.

    A sampled threshold and one compaction pass instead of a sort: the count is k within the
    tolerance of kernels.selection (at most its capacity), and every element returned has a
    magnitude at least that of every element left out. Waits for the device once.
    """
    flat = _flat(x, "x")
    if k == 0 or flat.numel() == 0:
        if k:
            raise ValueError(f"k must be 0 for an empty tensor, got {k}")
        return torch.empty(0, dtype=torch.int32, device=flat.device), flat[:0]
    plan = SelectionPlan.for_k(flat.numel(), k)
    out, workspace = allocate(PayloadLayout(flat.numel(), plan.capacity, flat.dtype, None), plan, flat.device)
    _backend(flat).select(flat, None, plan, out, workspace)
    selected, nonfinite = out.counts()
    if nonfinite:
        raise NonFiniteGradientError(nonfinite, flat.numel(), with_residual=False)
    sent = min(selected, plan.capacity)
    return out.indices[:sent], out.values[:sent]


def _flat(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.dtype not in _FLOAT_DTYPES or not t.is_contiguous():
        raise ValueError(f"{name} must be a contiguous float32, bfloat16 or float16 tensor, got "
                         f"{t.dtype}{'' if t.is_contiguous() else ' (not contiguous)'}; DDP's flat buckets are")
    return t.view(-1)


def _check_residual(flat: torch.Tensor, residual: torch.Tensor) -> None:
    if (residual.dtype != torch.float32 or not residual.is_contiguous() or residual.numel() != flat.numel()
            or residual.device != flat.device):
        raise ValueError(f"residual must be a contiguous float32 tensor of the bucket's {flat.numel()} elements "
                         f"on {flat.device}, got {residual.dtype} {tuple(residual.shape)} on {residual.device}; "
                         "create it once per bucket with torch.zeros(bucket.numel(), dtype=torch.float32, "
                         "device=bucket.device) and keep it across steps")


def _backend(t: torch.Tensor) -> ModuleType:
    if use_triton(t):
        from kernels import triton_kernels
        return triton_kernels
    return reference
