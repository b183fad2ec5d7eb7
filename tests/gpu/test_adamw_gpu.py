"""The one-pass AdamW kernel (kernels/triton_adamw.py) on a GPU against torch's fused AdamW, from bf16
gradients (bf16 weights) and from fp32 ones (autocast), and the engine's one-pass steps against its
steps through torch's fused AdamW.

Run on a CUDA machine from the repository root:
    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_adamw_gpu.py -p no:cacheprovider
"""

import copy

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: it comes with CUDA builds of torch, so no CUDA here")

from core.config import JobConfig  # noqa: E402
from kernels.adamw import AdamWFromBf16, AdamWFromFp32  # noqa: E402
from tests.adamw_support import bucket_views  # noqa: E402
from tests.engine_support import engine_spec  # noqa: E402
from tests.gpu.test_train_step_gpu import config, train  # noqa: E402
from workers import checkpoint  # noqa: E402
from workers.engine import Engine  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda", 0)
SHAPES = [(1,), (1000,), (65537,), (3 * 2**20,), (257, 129)]
STEPS = 5
GRAD_SCALE = 1.7


def parameters() -> list[torch.nn.Parameter]:
    gen = torch.Generator(device=CUDA).manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, device=CUDA, generator=gen)) for shape in SHAPES]


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    """Fused, as workers.optim makes it on a GPU, in two groups: one decayed, one not."""
    return torch.optim.AdamW([{"params": params[0::2], "weight_decay": 0.1},
                              {"params": params[1::2], "weight_decay": 0.0}], lr=3e-3, betas=(0.9, 0.95), fused=True)


def bf16_gradients(step: int, bucket: bool) -> list[torch.Tensor | None]:
    """A step's gradients, smaller at each step; the second parameter has none at step 2. With
    `bucket`, views into one flat buffer at odd offsets (tests.adamw_support.bucket_views)."""
    gen = torch.Generator(device=CUDA).manual_seed(100 + step)
    grads = [(torch.randn(shape, device=CUDA, generator=gen) * 10.0 ** -step).bfloat16() for shape in SHAPES]
    if bucket:
        grads = bucket_views(grads)
    grads[1] = None if step == 2 else grads[1]
    return grads


def torch_steps(params, optimizer, steps, bucket: bool) -> None:
    """torch's fused AdamW on the fp32 gradients push_gradients would make, divided by GRAD_SCALE."""
    for step in steps:
        for param, grad in zip(params, bf16_gradients(step, bucket)):
            param.grad = None if grad is None else grad.float()
        optimizer.grad_scale = torch.tensor(GRAD_SCALE, device=CUDA)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def kernel_steps(params, optimizer, steps, bucket: bool) -> list[torch.Tensor]:
    """The same steps by the Triton kernel; returns the bf16 copies it wrote. Before the last step
    the optimizer's state is loaded again, into new tensors: the kernel's tables must follow."""
    copies = [p.detach().to(torch.bfloat16) for p in params]
    step = AdamWFromBf16(optimizer, params, copies)
    for s in steps:
        if s == STEPS - 1:
            optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        step.step(bf16_gradients(s, bucket), torch.tensor(GRAD_SCALE, device=CUDA))
    return copies


def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Bit for bit: the kernel does torch's fused kernel's fp32 arithmetic, fmas and all (kernels.adamw
    says which; torch 2.11 and 2.13 have the same). A torch whose fused AdamW rounds otherwise fails
    here, and kernels/triton_adamw.py must follow it."""
    apart = (ours != theirs).sum().item()
    assert apart == 0, f"{apart} of {ours.numel()} elements differ, by up to {(ours - theirs).abs().max().item():.3g}"


@pytest.mark.parametrize("bucket", [False, True], ids=["own-tensors", "bucket-views"])
@pytest.mark.parametrize("switch_at", [0, 2], ids=["from-the-start", "after-torch-steps"])
def test_the_kernel_steps_as_torch_fused_adamw_does(bucket, switch_at):
    """switch_at: the steps torch's fused AdamW takes before the kernel continues on its state."""
    reference, ours = parameters(), parameters()
    reference_optimizer, our_optimizer = adamw(reference), adamw(ours)
    torch_steps(reference, reference_optimizer, range(STEPS), bucket)
    torch_steps(ours, our_optimizer, range(switch_at), bucket)
    copies = kernel_steps(ours, our_optimizer, range(switch_at, STEPS), bucket)
    for a, b in zip(ours, reference):
        same(a.detach(), b.detach())
        state, their_state = our_optimizer.state[a], reference_optimizer.state[b]
        assert state.keys() == their_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert (state["step"].dtype, state["step"].device) == (torch.float32, a.device)
        assert torch.equal(state["step"], their_state["step"])
        same(state["exp_avg"], their_state["exp_avg"])
        same(state["exp_avg_sq"], their_state["exp_avg_sq"])
    assert float(our_optimizer.state[ours[1]]["step"]) == STEPS - 1  # no gradient at step 2: not stepped
    for weight, master in zip(copies, ours):
        assert torch.equal(weight, master.detach().to(torch.bfloat16))


def test_every_step_count_up_to_300_rounds_as_torch_does():
    """The bias corrections come from beta ** step, whose rounding at some step counts only the
    fused kernel's own powf reproduces: 300 steps of a small tensor, compared at each."""
    gen = torch.Generator(device=CUDA).manual_seed(1)
    reference, ours = (torch.nn.Parameter(torch.randn(4099, device=CUDA, generator=gen)) for _ in range(2))
    with torch.no_grad():
        ours.copy_(reference)
    reference_optimizer, our_optimizer = (torch.optim.AdamW([p], lr=1e-3, betas=(0.9, 0.95), fused=True)
                                          for p in (reference, ours))
    weight = ours.detach().to(torch.bfloat16)
    step = AdamWFromBf16(our_optimizer, [ours], [weight])
    for s in range(300):
        grad = torch.randn(4099, device=CUDA, generator=gen).bfloat16()
        reference.grad = grad.float()
        reference_optimizer.step()
        step.step([grad])
        same(ours.detach(), reference.detach())
    assert torch.equal(weight, ours.detach().to(torch.bfloat16))


def bf16_engine(fused: bool, **train_settings) -> tuple[Engine, JobConfig]:
    cfg = config(precision="bf16", bf16_weights=True, lr=1e-3, **train_settings)
    engine = Engine(engine_spec(cfg, 1, 16, 2), 0, CUDA)
    assert engine.fused_bf16_step  # a GPU with triton takes the one-pass step by itself
    engine.fused_bf16_step = fused
    return engine, cfg


def test_the_engine_trains_as_its_unfused_step_does(dataset_dir):
    """20 steps each way, clipping at grad_clip = 0.05 so that the clip acts: the same losses, bit for
    bit (the same gradient norm, the same AdamW arithmetic, the same bf16 copy)."""
    curves, masters = {}, {}
    for fused in (True, False):
        engine, cfg = bf16_engine(fused, steps=20, grad_clip=0.05)
        curves[fused] = train(engine, cfg, dataset_dir)
        masters[fused] = [p.detach().clone() for p in engine.model.parameters()]
        assert all(p.grad is None for p in engine.model.parameters())
    assert curves[True] == curves[False], f"fused {curves[True]} against unfused {curves[False]}"
    for ours, theirs in zip(masters[True], masters[False]):
        same(ours, theirs)
    assert sum(curves[True][-5:]) / 5 < curves[True][0] - 0.5, curves[True]


def test_a_checkpoint_restored_mid_run_reaches_the_copy(dataset_dir, tmp_path):
    """The kernel's writes leave the masters' versions alone, a restore's do not: after a restore the
    next step pulls the restored masters into the copy and trains them as when they were saved."""
    engine, cfg = bf16_engine(True, steps=3)
    train(engine, cfg, dataset_dir)
    info = checkpoint.CheckpointInfo.for_spec(engine.spec, 3, 3 * 32, world_size=1)
    checkpoint.save(tmp_path / "step_3", engine.model, engine.optimizer, info)
    batches = [torch.randint(0, 257, (16, 65), device=CUDA, generator=torch.Generator(CUDA).manual_seed(i))
               for i in range(2)]
    expected = engine(batches, lr=1e-3)[0]
    engine(batches, lr=1e-3)
    checkpoint.load(tmp_path / "step_3", engine.model, engine.optimizer)
    assert torch.equal(engine(batches, lr=1e-3)[0], expected)


def fp32_gradients(step: int, bucket: bool) -> list[torch.Tensor | None]:
    """A step's fp32 gradients (every bit of the mantissa used: a kernel that read them as bf16 would
    round them), smaller at each step; the second parameter has none at step 2. With `bucket`, views
    into one flat buffer at odd offsets."""
    gen = torch.Generator(device=CUDA).manual_seed(200 + step)
    grads = [torch.randn(shape, device=CUDA, generator=gen) * 10.0 ** -step for shape in SHAPES]
    if bucket:
        grads = bucket_views(grads)
    grads[1] = None if step == 2 else grads[1]
    return grads


@pytest.mark.parametrize("bucket", [False, True], ids=["own-tensors", "bucket-views"])
@pytest.mark.parametrize("switch_at", [0, 2], ids=["from-the-start", "after-torch-steps"])
def test_the_fp32_form_steps_as_torch_fused_adamw_does_and_leaves_the_gradients(bucket, switch_at):
    """torch's fused AdamW with a grad_scale for STEPS steps against AdamWFromFp32 from step switch_at:
    parameters and moments bit for bit; torch's gradients come back divided, ours as they were."""
    reference, ours = parameters(), parameters()
    reference_optimizer, our_optimizer = adamw(reference), adamw(ours)
    step = AdamWFromFp32(our_optimizer)
    for s in range(STEPS):
        grads = fp32_gradients(s, bucket)
        before = [None if grad is None else grad.clone() for grad in grads]
        for a, b, grad in zip(ours, reference, grads):
            a.grad = grad  # the views themselves with `bucket`
            b.grad = None if grad is None else grad.clone()
        reference_optimizer.grad_scale = torch.tensor(GRAD_SCALE, device=CUDA)
        reference_optimizer.step()
        if s < switch_at:
            our_optimizer.grad_scale = torch.tensor(GRAD_SCALE, device=CUDA)
            our_optimizer.step()
        else:
            if s == STEPS - 1:  # the state loaded again into new tensors: the kernel's tables must follow
                our_optimizer.load_state_dict(copy.deepcopy(our_optimizer.state_dict()))
            step.step(torch.tensor(GRAD_SCALE, device=CUDA))
            for a, grad in zip(ours, before):
                assert grad is None or torch.equal(a.grad, grad)  # read, not written
        reference_optimizer.zero_grad(set_to_none=True)
        our_optimizer.zero_grad(set_to_none=True)
    for a, b in zip(ours, reference):
        same(a.detach(), b.detach())
        state, their_state = our_optimizer.state[a], reference_optimizer.state[b]
        assert torch.equal(state["step"], their_state["step"])
        same(state["exp_avg"], their_state["exp_avg"])
        same(state["exp_avg_sq"], their_state["exp_avg_sq"])
    assert float(our_optimizer.state[ours[1]]["step"]) == STEPS - 1  # no gradient at step 2: not stepped


def test_the_autocast_engine_trains_as_with_torchs_fused_adamw(dataset_dir):
    """20 steps each way, clipping at grad_clip = 0.05 so that the clip acts: AdamWFromFp32 (what a GPU
    with triton takes by itself) against torch's fused AdamW with the clip as grad_scale: the same
    losses and weights, bit for bit."""
    curves, weights = {}, {}
    for one_pass in (True, False):
        cfg = config(precision="bf16", lr=1e-3, steps=20, grad_clip=0.05)
        engine = Engine(engine_spec(cfg, 1, 16, 2), 0, CUDA)
        assert engine.adamw_from_fp32 is not None
        if not one_pass:
            engine.adamw_from_fp32 = None
        curves[one_pass] = train(engine, cfg, dataset_dir)
        weights[one_pass] = [p.detach().clone() for p in engine.model.parameters()]
    assert curves[True] == curves[False], f"one pass {curves[True]} against torch's {curves[False]}"
    for ours, theirs in zip(weights[True], weights[False]):
        same(ours, theirs)
    assert sum(curves[True][-5:]) / 5 < curves[True][0] - 0.5, curves[True]
