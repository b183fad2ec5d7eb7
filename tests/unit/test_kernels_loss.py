"""The fused linear + cross-entropy (kernels.loss): its torch twin against the plain loss on CPU,
inside a compiled graph, and its Triton kernel in Triton's interpreter against the twin."""

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from kernels import loss as loss_module
from kernels.loss import IGNORE_INDEX, _twin_rows, cross_entropy_rows_twin, linear_cross_entropy
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


def test_the_backward_makes_one_fp32_copy_of_the_weight_gradient():
    """With a large vocabulary the backward's temporaries are the step's peak (Llama-3: a 128 K x 2048
    head, 8,192 rows): it makes the head's gradient in bf16 and scales it into one fp32 tensor, 6 bytes
    an element, no second fp32 copy."""
    from planning.memory import _StorageTimeline
    rows, width, vocab = 64, 64, 8192
    hidden, weight, targets = case(rows=rows, width=width, vocab=vocab, seed=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(hidden, weight, targets)
    with _StorageTimeline(round_to=1) as timeline:
        loss.backward()
    # Beside them: the saved bf16 gradient logits and normed hidden (counted as backward unpacks them),
    # and the zero gradient autograd makes for the gradient-logits output (rows x vocab, bf16).
    beside = 2 * rows * vocab + 2 * rows * width + 2 * rows * vocab
    assert 6 * weight.numel() <= timeline.peak - beside < 7 * weight.numel()


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


@pytest.mark.parametrize("gradient_scale", [None, 0.37])
def test_twin_takes_low_precision_rows_a_block_at_a_time_with_the_same_numbers(monkeypatch, gradient_scale):
    """Blocks of 3 rows of 10 (TWIN_CHUNK_BYTES 120): losses and gradients bit for bit those of one pass,
    with ignored rows on both sides of a block's edge."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(8, 10, generator=g) * 3).bfloat16()
    targets = torch.randint(0, 10, (8,), generator=g)
    targets[[2, 3]] = IGNORE_INDEX
    whole, blocks = logits.clone(), logits.clone()
    want = cross_entropy_rows_twin(whole, targets, gradient_scale)
    monkeypatch.setattr(loss_module, "TWIN_CHUNK_BYTES", 3 * 4 * 10)
    made = []
    monkeypatch.setattr(loss_module, "_twin_rows", lambda rows, *a: made.append(len(rows)) or _twin_rows(rows, *a))
    assert torch.equal(cross_entropy_rows_twin(blocks, targets, gradient_scale), want)
    assert torch.equal(blocks, whole) and made == [3, 3, 2]


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
    # A few roundings of the dtype apart. In fp32 the log-sum of a row is a sum of `vocab` exps whose
    # order differs; the twin's (torch's CPU logsumexp) is not even the same from one run to the next
    # on the same inputs (6 of 25 runs here were up to 2.1e-5 off the others, on losses of 7.6 to 14).
    results.append({"losses": torch.allclose(got_losses, want_losses, rtol=1e-5, atol=0),
                    "evaluation": torch.equal(eval_losses, got_losses) and torch.equal(untouched, logits),
                    "gradient": torch.allclose(got.float(), want.float(), rtol=max(5e-5, torch.finfo(dtype).eps),
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


def normed_case(bias: bool, seed: int = 5):
    hidden, weight, targets = case(seed=seed)
    norm = torch.nn.LayerNorm(hidden.shape[1], bias=bias)
    with torch.no_grad():  # not the identity init: the norm's gradients must be made right, not merely exist
        norm.weight.uniform_(0.5, 1.5)
        if bias:
            norm.bias.uniform_(-0.2, 0.2)
    return hidden, weight, targets, norm


def gradients(loss, hidden, weight, norm):
    return torch.autograd.grad(loss, (hidden, weight, *norm.parameters()))


@pytest.mark.parametrize("bias", [True, False])
def test_the_norm_inside_the_op_matches_a_norm_before_the_plain_loss(bias):
    hidden, weight, targets, norm = normed_case(bias)
    plain = F.cross_entropy((norm(hidden) @ weight.t()).float(), targets)
    fused = linear_cross_entropy(hidden, weight, targets, norm)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-6)
    for got, want in zip(gradients(2.0 * fused, hidden, weight, norm), gradients(2.0 * plain, hidden, weight, norm)):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        assert linear_cross_entropy(hidden, weight, targets, norm).item() == pytest.approx(plain.item(), rel=1e-6)


def test_the_norm_inside_the_op_under_autocast_and_in_bf16():
    hidden, weight, targets, norm = normed_case(bias=True, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = F.cross_entropy((norm(hidden) @ weight.t()).float(), targets)
        fused = linear_cross_entropy(hidden, weight, targets, norm)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-3)
    for got, want in zip(gradients(fused, hidden, weight, norm), gradients(plain, hidden, weight, norm)):
        assert got.dtype == want.dtype == torch.float32 and (got - want).abs().max() <= 1e-2 * want.abs().max()
    # bf16 weights (the engine's compute copy): everything in bf16, no autocast.
    low = [t.detach().bfloat16().requires_grad_() for t in (hidden, weight)]
    low_norm = norm.to(torch.bfloat16)
    plain = F.cross_entropy((low_norm(low[0]) @ low[1].t()).float(), targets)
    fused = linear_cross_entropy(low[0], low[1], targets, low_norm)
    assert fused.item() == pytest.approx(plain.item(), rel=1e-2)
    for got, want in zip(gradients(fused, *low, low_norm), gradients(plain, *low, low_norm)):
        assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max() <= 5e-2 * want.float().abs().max()


def test_the_final_norm_and_the_casts_of_its_output_run_inside_the_op():
    # Inductor fused a final norm left outside the op, and the casts of its output, into a kernel that
    # raced on an H200 (kernels/loss.py says how): the compiled forward graph must hold neither.
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    forward_graphs = []

    def keep_forward(graph, _inputs):
        forward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    hidden, weight, targets, norm = normed_case(bias=True, seed=4)
    backend = aot_autograd(fw_compiler=keep_forward, bw_compiler=lambda graph, _inputs: make_boxed_func(graph.forward),
                           partition_fn=min_cut_rematerialization_partition)
    torch._dynamo.reset()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = torch.compile(linear_cross_entropy, backend=backend, fullgraph=True)(hidden, weight, targets, norm)
    loss.backward()
    norm_or_cast = (torch.ops.aten.native_layer_norm.default, torch.ops.aten.var_mean.correction,
                    torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
    first_output = lambda node: node.meta["val"][0] if isinstance(node.meta["val"], tuple) else node.meta["val"]  # noqa: E731
    outside = [str(node.target) for node in forward_graphs[0].graph.nodes
               if node.target in norm_or_cast and first_output(node).shape[0] == hidden.shape[0]]
    assert outside == [] and hidden.grad is not None and norm.weight.grad is not None
