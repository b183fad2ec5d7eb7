"""The one-pass AdamW kernel (kernels/triton_adamw.py) as Triton compiles it for an H100/H200 (sm_90),
read on the CPU: where the host has checked every address is a multiple of 16 (ALIGNED), the full chunks
move 16 bytes a load and store, in both forms. Its addresses come from a table on the GPU, so Triton
knows nothing of their alignment but the hint; put on the int64 address before its cast to a pointer,
the hint was dropped and every access was 4 bytes wide, unseen, from the kernel's first measurement on."""

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed; install it to compile the kernels")


def ptx(from_bf16: bool, aligned: bool) -> str:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, compile

    from kernels import triton_adamw
    signature = {"tensors_ptr": "*i64", "chunks_ptr": "*i32", "hyper_ptr": "*fp32", "powers_ptr": "*fp32",
                 "grad_scale_ptr": "*fp32", "HAS_SCALE": "constexpr", "FROM_BF16": "constexpr",
                 "ALIGNED": "constexpr", "CHUNK": "constexpr", "BLOCK": "constexpr"}
    tuning = triton_adamw.ADAMW_TUNING
    constants = {"HAS_SCALE": True, "FROM_BF16": from_bf16, "ALIGNED": aligned, "CHUNK": tuning.chunk,
                 "BLOCK": tuning.block}
    source = ASTSource(triton_adamw._adamw_kernel, signature, constants)
    return compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": tuning.warps}).asm["ptx"]


@pytest.mark.parametrize("from_bf16", [True, False], ids=["from-bf16", "from-fp32"])
def test_aligned_tensors_are_stepped_16_bytes_at_a_time(from_bf16):
    code = ptx(from_bf16, aligned=True)
    assert "ld.global.v4" in code and "st.global.v4" in code


def test_unaligned_tensors_are_not():
    code = ptx(from_bf16=True, aligned=False)
    assert "ld.global.v4" not in code and "st.global.v4" not in code
