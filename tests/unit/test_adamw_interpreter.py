"""The one-pass AdamW kernel (kernels/triton_adamw.py) run by Triton's CPU interpreter against its torch
twin (kernels.adamw), in both forms: from bf16 gradients writing bf16 copies, and from fp32 gradients
writing nothing but the parameters and moments.

Catches what the kernel's logic can get wrong on a machine without a GPU: a table field read for
another, a chunk or tail skipped, a group's settings taken for another's, a copy not written, a
gradient written. Not its rounding: the interpreter has no libdevice (the child stands in Triton's own
correctly rounded division and square root, which round as libdevice's do), its fma rounds twice and
its cast to bf16 truncates, so values are compared to a few ulps and copies to the truncated masters.
tests/gpu/test_adamw_gpu.py holds the compiled kernel to torch's fused AdamW bit for bit.
"""

import importlib.util

import pytest

from tests.interpreter_support import run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed; install it to check the kernels in its interpreter")

SCRIPT = r"""
import copy, json, types
import torch
import triton.language as tl
from kernels import triton_adamw
from kernels.adamw import AdamWFromBf16, AdamWFromFp32, adamw_twin, advance_steps
from tests.adamw_support import bucket_views

# No libdevice in the interpreter: Triton's own correctly rounded ops, looked up when called (patched then).
triton_adamw.libdevice = types.SimpleNamespace(div_rn=lambda a, b: tl.div_rn(a, b), sqrt_rn=lambda a: tl.sqrt_rn(a))
torch.set_grad_enabled(False)

SHAPES = [(1,), (8193,), (1000,), (64, 33)]  # 8193: two chunks, the second a one-element tail
STEPS = 4

def parameters():
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]

def adamw(params):
    # two groups, each with its own lr and weight decay, their parameters out of the model's order
    return torch.optim.AdamW([{"params": [params[0], params[3]], "weight_decay": 0.1},
                              {"params": [params[1], params[2]], "weight_decay": 0.0, "lr": 1e-3}],
                             lr=3e-3, betas=(0.9, 0.95))

def gradients(step, dtype, bucket):
    # smaller at each step; the last parameter has none at step 2; with `bucket`, views into one flat
    # buffer at odd offsets (no 16-byte alignment), as DDP's buckets may hold them
    gen = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(shape, generator=gen) * 10.0 ** -step).to(dtype) for shape in SHAPES]
    if bucket:
        grads = bucket_views(grads)
    grads[3] = None if step == 2 else grads[3]
    return grads

def train(form, bucket, scaled, kernel):
    params = parameters()
    optimizer = adamw(params)
    copies = [p.detach().bfloat16() for p in params]
    step = AdamWFromBf16(optimizer, params, copies) if form == "bf16" else AdamWFromFp32(optimizer)
    tables = triton_adamw.DeviceTables()
    gradients_kept = True
    for s in range(STEPS):
        if s == STEPS - 1:  # the state loaded again into new tensors: the kernel's tables must follow
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        grads = gradients(s, torch.bfloat16 if form == "bf16" else torch.float32, bucket)
        before = [None if g is None else g.clone() for g in grads]
        scale = torch.tensor(1.7) if scaled else None
        by_master = {id(p): g for p, g in zip(params, grads)}  # step.masters: the optimizer's order for fp32
        tensors, hyper = step._gather([by_master[id(m)] for m in step.masters])
        if kernel:
            triton_adamw.adamw_step(tables, tensors, hyper, scale)
        else:  # what kernels.adamw runs off CUDA
            advance_steps(tensors)
            for t in tensors:
                adamw_twin(t, hyper[t.group], scale)
        gradients_kept &= all(g is None or torch.equal(g, b) for g, b in zip(grads, before))
    state = [optimizer.state[p] for p in params]
    return {"params": [p.detach().flatten().tolist() for p in params],
            "exp_avg": [s["exp_avg"].flatten().tolist() for s in state],
            "exp_avg_sq": [s["exp_avg_sq"].flatten().tolist() for s in state],
            "steps": [float(s["step"]) for s in state],
            "copies_truncated": [torch.equal(c.view(torch.int16), (p.detach().view(torch.int32) >> 16).to(torch.int16))
                                 for c, p in zip(copies, params)],
            "moved": [not torch.equal(p, q) for p, q in zip(params, parameters())],
            "gradients_kept": gradients_kept}

results = []
for form in ("bf16", "fp32"):
    for bucket in (False, True):
        for scaled in (True, False):
            results.append({"form": form, "bucket": bucket, "scaled": scaled,
                            "kernel": train(form, bucket, scaled, True), "twin": train(form, bucket, scaled, False)})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def cases() -> list[dict]:
    return run_interpreted(SCRIPT, timeout_s=300)


def close(ours: list[list[float]], theirs: list[list[float]], what: str) -> None:
    """Within 1e-6 of each tensor's largest magnitude: the interpreter's fma and the twin's round
    otherwise (2.4e-7 apart at most on these values, measured)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        scale = max(abs(x) for x in b)
        worst = max(abs(x - y) for x, y in zip(a, b))
        assert worst <= 1e-6 * scale, f"{what} of parameter {i}: {worst:.3g} apart (largest magnitude {scale:.3g})"


def test_the_kernel_steps_as_its_twin_in_both_forms(cases):
    assert len(cases) == 8
    for case in cases:
        label = f"{case['form']} gradients, {'bucket views' if case['bucket'] else 'own tensors'}, " \
                f"{'scaled' if case['scaled'] else 'unscaled'}"
        kernel, twin = case["kernel"], case["twin"]
        for key in ("params", "exp_avg", "exp_avg_sq"):
            close(kernel[key], twin[key], f"{label}: {key}")
        assert kernel["steps"] == twin["steps"] == [4.0, 4.0, 4.0, 3.0], label  # no gradient at step 2: not stepped
        assert all(kernel["moved"]), label
        if case["form"] == "bf16":
            assert all(kernel["copies_truncated"]), f"{label}: copies {kernel['copies_truncated']}"
        assert kernel["gradients_kept"] and twin["gradients_kept"], f"{label}: a gradient was written"


def test_the_grad_scale_reaches_the_step(cases):
    """The same gradients scaled and unscaled train to different weights (a kernel that ignored the
    scale would pass the comparison above only if the twin ignored it too)."""
    for form in ("bf16", "fp32"):
        scaled, unscaled = (next(c["kernel"] for c in cases if c["form"] == form and not c["bucket"]
                                 and c["scaled"] is s) for s in (True, False))
        assert scaled["exp_avg"][1] != unscaled["exp_avg"][1]
