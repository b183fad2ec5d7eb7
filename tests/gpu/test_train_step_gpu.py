"""The worker engine on a CUDA device, without Ray: bf16 autocast, fused AdamW, real data."""

import copy
import math

import pytest
import torch

from core.config import JobConfig
from core.plan import BatchLayout
from core.schedule import LrSchedule
from storage.sampler import DeterministicSampler
from storage.shards import TokenDataset
from tests.engine_support import engine_spec
from workers.engine import Engine
from workers.optim import build_optimizer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def config(**train) -> JobConfig:
    return JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 64},
                                "train": {"steps": 60, "global_batch_size": 32, "micro_batch_size": 16,
                                          "lr": 3e-3, "warmup_steps": 5, **train},
                                "cluster": {"num_workers": 1, "use_gpu": True}})


def train(engine: Engine, cfg: JobConfig, dataset_dir) -> list[float]:
    data = TokenDataset(dataset_dir, "train", cfg.model.seq_len)
    sampler = DeterministicSampler(data.num_samples, seed=0)
    layout = BatchLayout((16,), 2)
    losses = []
    for s in range(cfg.train.steps):
        ids = sampler.rank_micro_batches(s * layout.global_batch, layout, 0)
        batches = [torch.from_numpy(data.batch(i)).to(engine.device) for i in ids]
        loss, grad_norm = engine(batches, LrSchedule.for_train(cfg.train).lr_at(s))
        losses.append(loss.item())
        assert math.isfinite(grad_norm.item())
    return losses


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_engine_learns_on_the_gpu(dataset_dir, precision):
    cfg = config(precision=precision)
    engine = Engine(engine_spec(cfg, 1, 16, 2), 0, torch.device("cuda", 0))
    assert engine.precision.name == precision and engine.optimizer.defaults["fused"] is True
    losses = train(engine, cfg, dataset_dir)
    assert abs(losses[0] - math.log(257)) < 0.2
    assert sum(losses[-5:]) / 5 < 3.0
    metrics = engine.window_metrics()
    if precision == "fp16":
        assert metrics["skipped_steps"] <= 3 and metrics["loss_scale"] > 0  # a few at the start, as the scale settles


def test_bf16_weights_learn_as_autocast_does_compiled(dataset_dir):
    """The bf16 compute copy under torch.compile: the same loss curve as bf16 autocast's within 2 %
    at every 10-step mean, fp32 masters and fp32 AdamW states.

    At lr 1e-3: at the other tests' 3e-3 this tiny model's curve forks on any rounding change. There,
    on one H200 over seeds 0-4, bf16 weights ended +4.0 %, +0.1 %, -1.0 %, +0.1 %, -0.0 % from
    autocast, and autocast with the plain loss kernel moved seed 2's end by 0.8 % on its own. At 1e-3
    every seed's every window was within 0.9 % (largest, seed 4) and the plain kernel within 0.02 %."""
    curves = {}
    for bf16_weights in (False, True):
        cfg = JobConfig.from_dict({**config(precision="bf16", bf16_weights=bf16_weights, lr=1e-3).to_dict(),
                                   "compile": {"enable": True}})
        engine = Engine(engine_spec(cfg, 1, 16, 2), 0, torch.device("cuda", 0))
        curves[bf16_weights] = train(engine, cfg, dataset_dir)
        torch._dynamo.reset()
    windows = {key: [round(sum(losses[i:i + 10]) / 10, 4) for i in range(0, len(losses), 10)]
               for key, losses in curves.items()}
    seen = f"10-step means, bf16 weights {windows[True]} against autocast {windows[False]}"
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    assert engine.compile_check["relative_difference"] < 1e-3, engine.compile_check
    for ours, theirs in zip(windows[True], windows[False]):
        assert ours == pytest.approx(theirs, rel=0.02), seen
    assert sum(curves[True][-5:]) / 5 < 3.0, seen


def test_bf16_is_the_default_on_a_gpu():
    engine = Engine(engine_spec(config(), 1, 16, 2), 0, torch.device("cuda", 0))
    assert engine.precision.name == "bf16"


def test_clipping_inside_fused_adamw_matches_clip_grad_norm():
    """The engine folds the clip into AdamW's grad_scale (kernels.adamw's fp32 form on a GPU with triton);
    the step must be clip_grad_norm_ + step."""
    cfg = config(grad_clip=0.05)  # small enough that the clip acts
    engine = Engine(engine_spec(cfg, 1, 16, 2), 0, torch.device("cuda", 0))
    assert engine.clip_in_optimizer
    reference = copy.deepcopy(engine.model)
    optimizer = build_optimizer(reference, cfg.train, engine.device)
    batch = torch.randint(0, 257, (16, 65), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.autocast("cuda", torch.bfloat16):
        engine.model(batch[:, :-1], batch[:, 1:]).backward()
    for ours, theirs in zip(engine.model.parameters(), reference.parameters()):
        theirs.grad = ours.grad.clone()
    norm = engine._clip_and_step()
    want = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
    optimizer.step()
    assert norm.item() > 0.05 and torch.allclose(norm, want, rtol=1e-6)
    for ours, theirs in zip(engine.model.parameters(), reference.parameters()):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def test_a_llama_1b_on_random_tokens_passes_the_compile_check_in_full_precision():
    """Uniformly random tokens over Llama-3.2-1B's 128 K vocabulary at the initial weights: on an H200
    the compiled bf16 gradients were 3.5-3.7 % from eager bf16's (benchmarks/RESULTS.md, 2026-12-04),
    over the 3 % tolerance, with the losses 2e-5 apart. The full-precision pass must find the compiled
    gradients no further from it than twice eager bf16's distance, and the step train."""
    cfg = JobConfig.from_dict({"model": {"preset": "llama3-1b", "seq_len": 2048},
                               "compile": {"enable": True},
                               "train": {"global_batch_size": 4, "micro_batch_size": 4, "precision": "bf16",
                                         "warmup_steps": 0},
                               "cluster": {"num_workers": 1, "use_gpu": True}})
    engine = Engine(engine_spec(cfg, 1, 4, 1), 0, torch.device("cuda", 0))
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, cfg.model.vocab_size, (4, 2049), generator=generator).cuda()
    loss, grad_norm = engine([batch], 3e-4)
    check = engine.compile_check
    print(check)  # with -s: whether the full-precision pass ran, and its two distances
    assert not check["gradient_wrong"] and math.isfinite(grad_norm.item()) and math.isfinite(loss.item())
