"""The worker's training step on a CUDA device, without Ray: bf16 autocast, fused AdamW, real data."""

import math

import pytest
import torch

from orchestrator.config import JobConfig
from storage.sampler import BatchLayout, DeterministicSampler
from storage.shards import TokenDataset
from workers.models.gpt import GPT
from workers.optim import build_optimizer, lr_at
from workers.step import TrainStep, autocast_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_is_the_default_on_a_gpu():
    assert autocast_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16


def test_train_step_learns_on_the_gpu(dataset_dir):
    config = JobConfig.from_dict({"model": {"n_layer": 2, "n_head": 4, "n_embd": 128, "seq_len": 64},
                                  "train": {"steps": 60, "global_batch_size": 32, "micro_batch_size": 16,
                                            "lr": 3e-3, "warmup_steps": 5},
                                  "cluster": {"num_workers": 1, "use_gpu": True}})
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = GPT(config.model).to(device)
    optimizer = build_optimizer(model, config.train, device)
    assert optimizer.defaults["fused"] is True
    step = TrainStep(model, optimizer, config, device)
    data = TokenDataset(dataset_dir, "train", config.model.seq_len)
    sampler = DeterministicSampler(data.num_samples, seed=0)
    layout = BatchLayout.uniform(1, 16, config.grad_accum_steps)
    losses = []
    for s in range(config.train.steps):
        ids = sampler.rank_micro_batches(s * layout.global_batch, layout, 0)
        batches = [torch.from_numpy(data.batch(i)).to(device) for i in ids]
        loss, grad_norm = step(batches, lr_at(s, config.train))
        losses.append(loss.item())
        assert math.isfinite(grad_norm.item())
    assert abs(losses[0] - math.log(257)) < 0.2
    assert sum(losses[-5:]) / 5 < 3.0
    assert torch.cuda.max_memory_allocated() < 2**30
