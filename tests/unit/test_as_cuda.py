"""The memory estimate's stand-in for CUDA's fused rms_norm (planning/as_cuda.py): it computes torch's
rms_norm, and a CUDA target's estimate keeps for backward what the fused kernel keeps, not the fp32 copy
of the normalised input that the CPU's decomposition keeps (2.0 GiB at the Llama-3.2-1B shape, B = 4)."""

import contextlib
from unittest import mock

import pytest
import torch
import torch.nn.functional as F

from core.config import ModelConfig
from planning import memory
from planning.as_cuda import FusedRMSNorm, cuda_ops


# bf16: up to two units in the last place apart (the two round their steps in another order)
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("weighted, eps", [(True, 1e-5), (True, None), (False, 1e-6)])
def test_the_stand_in_computes_torch_s_rms_norm_and_its_gradients(dtype, tolerance, weighted, eps):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    weight = (1 + torch.randn(16) / 4).to(dtype).requires_grad_() if weighted else None
    grad = torch.randn(3, 5, 16, dtype=dtype)
    results = []
    for norm in (lambda: F.rms_norm(x, (16,), weight, eps), lambda: FusedRMSNorm.apply(x, (16,), weight, eps)):
        out = norm()
        grads = torch.autograd.grad(out, [x] + ([weight] if weighted else []), grad)
        results.append((out, *grads))
    for torch_s, ours in zip(*results):
        assert ours.dtype == torch_s.dtype
        torch.testing.assert_close(ours, torch_s, rtol=tolerance, atol=tolerance)


def test_under_the_mode_rms_norm_modules_run_the_stand_in():
    norm = torch.nn.RMSNorm(8)
    with cuda_ops():
        out = norm(torch.randn(2, 8, requires_grad=True))
    assert type(out.grad_fn).__name__ == "FusedRMSNormBackward"


def test_a_cuda_estimate_drops_the_cpu_s_fp32_copy_of_each_normalised_block_input():
    """Autocast keeps the residual stream in fp32: the CPU's decomposition keeps one more rows x width fp32
    tensor per block norm (two a block); the final norm runs inside the fused loss and is unaffected."""
    model = ModelConfig(kind="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=64, ffn_dim=128, seq_len=32,
                        vocab_size=256)
    spec = memory.StepSpec(model=model, precision="bf16", device_type="cuda")
    micro_batch = 2
    memory._MEASURED.clear()
    as_cuda = memory.measure_step(spec, micro_batch).peak_bytes
    memory._MEASURED.clear()
    with mock.patch.object(memory, "cuda_ops", contextlib.nullcontext):
        as_cpu = memory.measure_step(spec, micro_batch).peak_bytes
    memory._MEASURED.clear()
    fp32_copy = micro_batch * model.seq_len * model.n_embd * 4
    assert as_cpu - as_cuda == 2 * model.n_layer * fp32_copy
