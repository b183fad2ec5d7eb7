"""A tiny GPT with optimizer state, for the checkpoint tests on CPU, in S3 and on a GPU."""

from __future__ import annotations

import torch

from core.config import JobConfig
from workers.models.gpt import GPT
from workers.optim import build_optimizer

CONFIG = JobConfig.from_dict({"model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "seq_len": 16},
                              "train": {"global_batch_size": 4, "micro_batch_size": 2},
                              "checkpoint": {"keep_last": 2, "async_save": True}, "cluster": {"num_workers": 2}})


def trained(seed: int, config: JobConfig = CONFIG, device: torch.device = torch.device("cpu"),
            batch_size: int = 2) -> tuple[GPT, torch.optim.Optimizer]:
    """A model and its optimizer after one step on random tokens, so the weights and the optimizer's
    moments all differ between seeds."""
    torch.manual_seed(seed)
    model = GPT(config.model).to(device)
    optimizer = build_optimizer(model, config.train, device)
    tokens = torch.randint(0, 257, (batch_size, config.model.seq_len + 1), device=device)
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    optimizer.step()
    return model, optimizer
