"""The fused linear + cross-entropy (kernels.loss): its torch twin against the plain loss on CPU,
inside a compiled graph, and its Triton kernel in Triton's interpreter against the twin."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels.loss import cross_entropy_rows_twin, linear_cross_entropy
from tests.interpreter_support import run_interpreted


def case(rows=300, width=64, vocab=257, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=g).requires_grad_()
    weight = (torch.randn(vocab, width, generator=g) * 0.3).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (rows,), generator=g)


def plain_loss_and_gradients(hidden, weight, targets, times=1.0):
    loss = F.cross_entropy((hidden @ weight.t()).float(), targets)
    grads = torch.autograd.grad(times * loss, (hidden, weight))
    return loss.item(), grads


def test_fused_loss_matches_the_plain_loss_and_gradients():
    hidden, weight, targets = case()
    want, (want_hidden, want_weight) = plain_loss_and_gradients(hidden, weight, targets, times=3.0)
    fused = linear_cross_entropy(hidden, weight, targets)
    got_hidden, got_weight = torch.autograd.grad(3.0 * fused, (hidden, weight))  # a loss weight reaches both
    assert fused.item() == pytest.approx(want, rel=1e-6)
    assert torch.allclose(got_hidden, want_hidden, rtol=1e-4, atol=1e-7)
    assert torch.allclose(got_weight, want_weight, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, targets).item() == pytest.approx(want, rel=1e-6)


def test_fused_loss_under_autocast_matches_the_plain_loss_to_1e3():
    # The matmuls run in bf16 as the plain loss's would under autocast; the loss in fp32.
    hidden, weight, targets = case(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy((hidden @ weight.t()).float(), targets)
        fused = linear_cross_entropy(hidden, weight, targets)
    want = torch.autograd.grad(plain, (hidden, weight))
    got = torch.autograd.grad(fused, (hidden, weight))
    assert fused.item() == pytest.approx(plain.item(), rel=1e-3)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype == torch.float32
        assert (g - w).abs().max() <= 1e-3 * w.abs().max()


def test_fp16_takes_the_plain_loss():
    # A GradScaler's scale is applied after the forward, so an fp16 gradient made in the forward
    # would underflow: fp16 gets exactly the plain loss and its gradients.
    hidden, weight, targets = case(seed=3)
    half_hidden = hidden.detach().half().requires_grad_()
    half_weight = weight.detach().half().requires_grad_()
    plain = F.cross_entropy((half_hidden @ half_weight.t()).float(), targets)
    want = torch.autograd.grad(plain, (half_hidden, half_weight))
    fused = linear_cross_entropy(half_hidden, half_weight, targets)
    got = torch.autograd.grad(fused, (half_hidden, half_weight))
    assert torch.equal(fused, plain) and all(torch.equal(g, w) for g, w in zip(got, want))


def test_fused_loss_compiles_into_one_graph():
    hidden, weight, targets = case(seed=2)
    want, _ = plain_loss_and_gradients(hidden, weight, targets)
    torch._dynamo.reset()
    compiled = torch.compile(linear_cross_entropy, fullgraph=True)  # a graph break would raise here
    loss = compiled(hidden, weight, targets)
    loss.backward()
    assert loss.item() == pytest.approx(want, rel=1e-5) and hidden.grad is not None


def test_twin_leaves_the_gradient_in_the_logits():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    assert torch.equal(cross_entropy_rows_twin(logits.clone(), torch.tensor([2, 0])),
                       cross_entropy_rows_twin(logits.clone(), torch.tensor([2, 0]), 0.5))
    losses = cross_entropy_rows_twin(logits, torch.tensor([2, 0]), 0.5)
    softmax = torch.softmax(torch.tensor([1.0, 2.0, 3.0]), 0)
    assert torch.allclose(losses, torch.tensor([-torch.log(softmax[2]).item(), torch.log(torch.tensor(3.0)).item()]))
    assert torch.allclose(logits[0], 0.5 * (softmax - torch.tensor([0.0, 0.0, 1.0])))
    assert torch.allclose(logits[1], 0.5 * torch.tensor([1 / 3 - 1, 1 / 3, 1 / 3]))


INTERPRETED = r"""
import json, torch
from kernels import triton_loss
from kernels.loss import cross_entropy_rows_twin

triton_loss.LOSS_TUNING = triton_loss.LossTuning(block=256, warps=4)   # several blocks a row
results = []
for rows, vocab, dtype in [(7, 1000, torch.float32), (5, 3001, torch.bfloat16)]:
    g = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, vocab, generator=g) * 3).to(dtype)
    targets = torch.randint(0, vocab, (rows,), generator=g)
    got, want = logits.clone(), logits.clone()
    got_losses = triton_loss.cross_entropy_rows(got, targets, 1.0 / rows)
    want_losses = cross_entropy_rows_twin(want, targets, 1.0 / rows)
    untouched = logits.clone()
    eval_losses = triton_loss.cross_entropy_rows(untouched, targets)  # evaluation: losses only
    # One rounding of the dtype apart (fp32: a few of exp's last bits, through the log-sum).
    results.append({"losses": torch.allclose(got_losses, want_losses, rtol=1e-6, atol=0),
                    "evaluation": torch.equal(eval_losses, got_losses) and torch.equal(untouched, logits),
                    "gradient": torch.allclose(got.float(), want.float(), rtol=max(1e-5, torch.finfo(dtype).eps),
                                               atol=1e-7)})
bad = torch.zeros(2, 300)
losses = triton_loss.cross_entropy_rows(bad, torch.tensor([1, 300]), 0.5)
results.append({"in range": bool(torch.isfinite(losses[0])), "out of range is NaN": bool(torch.isnan(losses[1]))})
print(json.dumps(results))
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="triton is not installed; install it to check the loss kernel in its interpreter")
def test_interpreted_loss_kernel_matches_the_twin():
    for row in run_interpreted(INTERPRETED):
        assert all(row.values()), row


def test_the_op_makes_the_bf16_hidden_backward_needs():
    # One cast, inside the op, reused by backward; left to AOTAutograd's partitioner, a second cast
    # landed in the forward graph, where Inductor fuses it into the final norm's kernel.
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs = []

    def keep_forward(graph, _inputs):
        forward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    hidden, weight, targets = case(seed=4)
    gain = torch.ones(hidden.shape[1], requires_grad=True)
    backend = aot_autograd(fw_compiler=keep_forward, bw_compiler=lambda graph, _inputs: make_boxed_func(graph.forward),
                           partition_fn=min_cut_rematerialization_partition)

    def normed_loss(x, w, g, t):
        return linear_cross_entropy(F.layer_norm(x, (x.shape[1],), g), w, t)

    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(normed_loss, backend=backend, fullgraph=True)(hidden, weight, gain, targets)
    loss.backward()
    casts = [node for node in forward_graphs[0].graph.nodes
             if node.target in (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
             and node.args[0].meta["val"].shape == hidden.shape]
    assert casts == [] and hidden.grad is not None
