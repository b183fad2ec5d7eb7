import math

import pytest
import torch

from core.config import ModelConfig, TrainConfig
from core.schedule import LrSchedule
from workers.models.gpt import GPT
from workers.optim import build_optimizer

CFG = ModelConfig(n_layer=2, n_head=2, n_embd=64, seq_len=32, vocab_size=257)


def test_loss_at_init_is_close_to_uniform():
    torch.manual_seed(0)
    model = GPT(CFG)
    idx = torch.randint(0, 257, (8, 32))
    loss = model(idx, torch.randint(0, 257, (8, 32)))
    assert abs(loss.item() - math.log(257)) < 0.05


def test_embeddings_are_tied():
    model = GPT(CFG)
    assert model.lm_head.weight is model.tok_emb.weight
    assert model.num_params() == sum(p.numel() for p in set(model.parameters()))


def test_causal_later_tokens_do_not_change_earlier_logits():
    torch.manual_seed(0)
    model = GPT(CFG).eval()
    a = torch.randint(0, 257, (1, 32))
    b = a.clone()
    b[0, 20:] = (b[0, 20:] + 1) % 257
    assert torch.allclose(model(a)[0, :20], model(b)[0, :20], atol=1e-5)
    assert not torch.allclose(model(a)[0, 20:], model(b)[0, 20:], atol=1e-5)


def test_overfits_a_tiny_batch():
    torch.manual_seed(0)
    model = GPT(CFG)
    train = TrainConfig(lr=3e-3, min_lr=3e-3, warmup_steps=0, weight_decay=0.0)
    optimizer = build_optimizer(model, train, torch.device("cpu"))
    batch = torch.randint(0, 257, (4, 33))
    for _ in range(150):
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    assert loss.item() < 0.1


def test_weight_decay_only_on_matrices():
    optimizer = build_optimizer(GPT(CFG), TrainConfig(), torch.device("cpu"))
    decay, no_decay = optimizer.param_groups
    assert all(p.dim() == 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() == 1 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0


def test_schedule_warms_up_then_decays_to_min_lr():
    schedule = LrSchedule.for_train(TrainConfig(steps=100, lr=1e-3, min_lr=1e-4, warmup_steps=10))
    assert schedule.lr_at(0) == 1e-4
    assert schedule.lr_at(9) == 1e-3
    assert abs(schedule.lr_at(55) - 5.5e-4) < 1e-9  # cosine midpoint
    assert abs(schedule.lr_at(100) - 1e-4) < 1e-12


def test_an_unknown_loss_kernel_is_refused_not_taken_as_plain():
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, seq_len=8, vocab_size=32))
    tokens = torch.randint(0, 32, (2, 9))
    with pytest.raises(ValueError, match="loss_kernel must be"):
        model(tokens[:, :-1], tokens[:, 1:], loss_kernel="fuzed")
