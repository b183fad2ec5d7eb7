"""The one-pass AdamW steps (kernels.adamw) on CPU, from bf16 gradients (bf16 weights) and from fp32
ones (autocast): their torch twin against torch's AdamW, the state it leaves for checkpoints, the
pull it saves the next step, the gradients the fp32 form leaves alone, and the engine's paths through
them (forced on CPU) against torch's step. tests/unit/test_adamw_interpreter.py runs the Triton kernel
in Triton's interpreter, tests/gpu/test_adamw_gpu.py on a GPU."""

import copy

import pytest
import torch

from kernels.adamw import AdamWFromBf16, AdamWFromFp32
from tests.engine_support import engine_spec
from tests.unit.test_compute_copy import config
from tests.unit.test_engine import MICRO, batches_for, train
from workers import checkpoint
from workers.compute_copy import Bf16ComputeCopy
from workers.engine import Engine

SHAPES = [(1,), (1000,), (65537,), (64, 33)]
STEPS = 5
GRAD_SCALE = 1.7


def parameters() -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in SHAPES]


def adamw(params: list[torch.nn.Parameter], fused: bool = False) -> torch.optim.AdamW:
    """Two groups, as workers.optim makes them: one decayed, one not."""
    return torch.optim.AdamW([{"params": [params[0], params[3]], "weight_decay": 0.1},
                              {"params": [params[1], params[2]], "weight_decay": 0.0}],
                             lr=3e-3, betas=(0.9, 0.95), fused=fused)


def bf16_gradients(step: int) -> list[torch.Tensor | None]:
    """A step's gradients, smaller at each step; the last parameter has none at step 2."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = [(torch.randn(shape, generator=gen) * 10.0 ** -step).bfloat16() for shape in SHAPES]
    grads[3] = None if step == 2 else grads[3]
    return grads


def torch_steps(params: list[torch.nn.Parameter], optimizer: torch.optim.AdamW, steps) -> None:
    """torch's AdamW on the fp32 gradients push_gradients would make, divided by GRAD_SCALE: by
    the fused kernel itself, or beforehand for the for-loop one, which takes no grad_scale."""
    for step in steps:
        for param, grad in zip(params, bf16_gradients(step)):
            param.grad = None if grad is None else grad.float()
            if grad is not None and not optimizer.defaults["fused"]:
                param.grad /= GRAD_SCALE
        optimizer.grad_scale = torch.tensor(GRAD_SCALE) if optimizer.defaults["fused"] else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def twin_steps(params: list[torch.nn.Parameter], optimizer: torch.optim.AdamW, steps) -> list[torch.Tensor]:
    """The same steps by AdamWFromBf16 (its twin, on CPU); returns the bf16 copies it wrote."""
    copies = [p.detach().to(torch.bfloat16) for p in params]
    step = AdamWFromBf16(optimizer, params, copies)
    for s in steps:
        step.step(bf16_gradients(s), torch.tensor(GRAD_SCALE))
    return copies


def close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Within 1e-6 of the tensor's largest magnitude. torch's AdamW on a CPU rounds otherwise than the
    fused CUDA kernel the twin follows (lerp, no fmas): a few ulps apart (3.3e-7 at most, measured)."""
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6 * theirs.abs().max().item())


def assert_same_training(ours, our_optimizer, theirs, their_optimizer) -> None:
    for a, b in zip(ours, theirs):
        close(a.detach(), b.detach())
        state, their_state = our_optimizer.state[a], their_optimizer.state[b]
        assert state.keys() == their_state.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert (state["step"].dtype, state["step"].device) == (their_state["step"].dtype, their_state["step"].device)
        assert torch.equal(state["step"], their_state["step"])
        close(state["exp_avg"], their_state["exp_avg"])
        close(state["exp_avg_sq"], their_state["exp_avg_sq"])


@pytest.mark.parametrize("fused", [False, True], ids=["for-loop", "fused"])
def test_the_twin_steps_as_torch_adamw_does(fused):
    ours, theirs = parameters(), parameters()
    our_optimizer, their_optimizer = adamw(ours), adamw(theirs, fused)
    copies = twin_steps(ours, our_optimizer, range(STEPS))
    torch_steps(theirs, their_optimizer, range(STEPS))
    assert_same_training(ours, our_optimizer, theirs, their_optimizer)
    assert float(our_optimizer.state[ours[3]]["step"]) == STEPS - 1  # no gradient at step 2: not stepped
    assert not torch.equal(ours[0], parameters()[0])
    for weight, master in zip(copies, ours):
        assert torch.equal(weight, master.detach().to(torch.bfloat16))


@pytest.mark.parametrize("first, then", [(twin_steps, torch_steps), (torch_steps, twin_steps)],
                         ids=["twin-then-torch", "torch-then-twin"])
def test_a_run_moves_between_the_twin_and_torch_through_a_state_dict(first, then):
    """The optimizer state is torch's own: saved after one path's steps and loaded into a fresh
    optimizer, the other path continues as all-torch training does."""
    reference = parameters()
    reference_optimizer = adamw(reference)
    torch_steps(reference, reference_optimizer, range(STEPS))
    before = parameters()
    before_optimizer = adamw(before)
    first(before, before_optimizer, range(3))
    after = parameters()
    after_optimizer = adamw(after)
    with torch.no_grad():
        torch._foreach_copy_(after, before)
    after_optimizer.load_state_dict(before_optimizer.state_dict())
    then(after, after_optimizer, range(3, STEPS))
    assert_same_training(after, after_optimizer, reference, reference_optimizer)


def test_the_next_pull_is_skipped_until_a_master_changes():
    """step_masters writes the copy, so the next pull_weights has nothing to do, unless a master was
    written since: by a restore's load_state_dict, or any in-place op."""
    master = torch.nn.Linear(8, 4)
    start = {k: v.clone() for k, v in master.state_dict().items()}
    compute = Bf16ComputeCopy(master, torch.nn.Linear(8, 4).to(torch.bfloat16))
    optimizer = torch.optim.AdamW(master.parameters(), lr=0.1)

    def step_and_mark_the_copy() -> None:
        for param in compute.params:
            param.grad = torch.ones_like(param)
        compute.step_masters(optimizer, torch.tensor(2.0))
        assert all(p.grad is None for p in compute.params)
        for weight, stepped in zip(compute.params, compute.master_params):
            assert torch.equal(weight, stepped.detach().to(torch.bfloat16))
        with torch.no_grad():
            for weight in compute.params:
                weight.fill_(7.0)  # what only a pull can undo

    step_and_mark_the_copy()
    compute.pull_weights()
    assert all(torch.equal(weight, torch.full_like(weight, 7.0)) for weight in compute.params)  # skipped
    master.load_state_dict(start)
    compute.pull_weights()
    for weight, name in zip(compute.params, ("weight", "bias")):
        assert torch.equal(weight, start[name].to(torch.bfloat16))

    step_and_mark_the_copy()
    with torch.no_grad():
        master.bias.mul_(2.0)  # one master changes: every copy is pulled
    compute.pull_weights()
    for weight, stepped in zip(compute.params, compute.master_params):
        assert torch.equal(weight, stepped.detach().to(torch.bfloat16))


def bf16_engine(fused: bool) -> Engine:
    """A bf16-weights engine, clipping at 0.2 (the tiny model's gradient norm is ~0.6 at first); with
    `fused`, on the GPU's path (one pass from the copy's gradients), run by the twin."""
    engine = Engine(engine_spec(config(precision="bf16", bf16_weights=True, grad_clip=0.2), 1, MICRO, 2), 0,
                    torch.device("cpu"))
    assert not engine.fused_bf16_step  # on a CPU it takes the unfused path by itself
    engine.fused_bf16_step = fused
    return engine


def test_each_engine_step_on_the_fused_path_is_the_unfused_step():
    """From the same masters and moments at every step: the same loss exactly (the same bf16 copy),
    the same clipped gradient norm, masters and moments within 1e-6 (see close). Run freely instead,
    the two drift apart: now and then a master a few ulps off rounds to the other bf16 neighbour in
    the copy, and AdamW, dividing by the root of the squared gradients, turns the change this makes
    in gradients near 0 into whole steps (here 0.2 % of the largest weight after 7 steps)."""
    fused, plain = bf16_engine(fused=True), bf16_engine(fused=False)
    assert_each_step_matches(fused, plain)
    assert all(p.grad is None for p in fused.compute_copy.params)


def assert_each_step_matches(one_pass: Engine, plain: Engine) -> None:
    """Five steps, each from `one_pass`'s weights and moments loaded into `plain`: the same loss, the same
    clipped norm, weights and moments within close(); and the loss falls."""
    losses = []
    for step in range(5):
        plain.model.load_state_dict(one_pass.model.state_dict())
        plain.optimizer.load_state_dict(copy.deepcopy(one_pass.optimizer.state_dict()))
        (loss, norm), (plain_loss, plain_norm) = (e(batches_for(step, 0, 1, 2), lr=3e-3) for e in (one_pass, plain))
        assert torch.equal(loss, plain_loss)
        assert norm > 0.2 and float(norm) == pytest.approx(float(plain_norm), rel=1e-6)  # clipped
        for ours, theirs in zip(one_pass.model.parameters(), plain.model.parameters()):
            close(ours.detach(), theirs.detach())
            assert ours.grad is None
            for key in ("exp_avg", "exp_avg_sq"):
                close(one_pass.optimizer.state[ours][key], plain.optimizer.state[theirs][key])
        losses.append(float(loss))
    assert losses[3] < losses[0]  # the same batch, 3 steps later


def test_a_checkpoint_restored_mid_run_reaches_the_copy(tmp_path):
    """The masters restored in place (workers.checkpoint) under a copy the fused step wrote: the next
    step trains the restored weights, as it did when they were saved."""
    engine = bf16_engine(fused=True)
    train(engine, 0, 1, 2, steps=3)
    info = checkpoint.CheckpointInfo.for_spec(engine.spec, 3, 3 * 8, world_size=1)
    checkpoint.save(tmp_path / "step_3", engine.model, engine.optimizer, info)
    expected = engine(batches_for(3, 0, 1, 2), lr=3e-3)[0]
    engine(batches_for(4, 0, 1, 2), lr=3e-3)
    checkpoint.load(tmp_path / "step_3", engine.model, engine.optimizer)
    assert torch.equal(engine(batches_for(3, 0, 1, 2), lr=3e-3)[0], expected)


def fp32_gradients(step: int) -> list[torch.Tensor | None]:
    return [None if g is None else g.float() for g in bf16_gradients(step)]


def test_the_fp32_form_steps_as_fused_adamw_does_and_leaves_the_gradients():
    """AdamWFromFp32's step is fused AdamW's with the same grad_scale, but where torch's fused AdamW
    writes each gradient back divided by the scale, it only reads them."""
    ours, theirs = parameters(), parameters()
    our_optimizer, their_optimizer = adamw(ours), adamw(theirs, fused=True)
    step = AdamWFromFp32(our_optimizer)
    for s in range(STEPS):
        grads = fp32_gradients(s)
        for a, b, grad in zip(ours, theirs, grads):
            a.grad = None if grad is None else grad.clone()
            b.grad = None if grad is None else grad.clone()
        step.step(torch.tensor(GRAD_SCALE))
        their_optimizer.grad_scale = torch.tensor(GRAD_SCALE)
        their_optimizer.step()
        for a, b, grad in zip(ours, theirs, grads):
            if grad is not None:
                assert torch.equal(a.grad, grad)  # read only
                torch.testing.assert_close(b.grad, grad / GRAD_SCALE)  # torch's, written back
        our_optimizer.zero_grad(set_to_none=True)
        their_optimizer.zero_grad(set_to_none=True)
    assert_same_training(ours, our_optimizer, theirs, their_optimizer)
    assert float(our_optimizer.state[ours[3]]["step"]) == STEPS - 1  # no gradient at step 2: not stepped


def test_the_fp32_form_refuses_parameters_that_are_not_fp32():
    params = parameters()
    params[1].data = params[1].data.bfloat16()
    with pytest.raises(ValueError, match="fp32 parameters"):
        AdamWFromFp32(adamw(params))


def autocast_engine(one_pass: bool) -> Engine:
    """An autocast engine clipping at 0.2; with `one_pass`, on the GPU's path (the clip as AdamWFromFp32's
    grad_scale), run by the twin; without, a CPU's (clip_grad_norm_, then torch's AdamW)."""
    engine = Engine(engine_spec(config(precision="bf16", grad_clip=0.2), 1, MICRO, 2), 0, torch.device("cpu"))
    assert engine.adamw_from_fp32 is None and not engine.clip_in_optimizer  # a CPU's AdamW is not fused
    if one_pass:
        engine.clip_in_optimizer = True
        engine.adamw_from_fp32 = AdamWFromFp32(engine.optimizer)
    return engine


def test_each_engine_step_on_the_fp32_one_pass_path_is_torchs_step():
    """From the same weights and moments at every step: the same loss exactly, the same clipped
    gradient norm, weights and moments within 1e-6 (see close)."""
    assert_each_step_matches(autocast_engine(one_pass=True), autocast_engine(one_pass=False))
