"""Models a user might bring, for the tests of [model] kind = "custom": a small LSTM language model
(not a transformer: no blocks the engine knows of), and factories that go wrong in each way a
factory can."""

from __future__ import annotations

import random

import torch
import torch.nn as nn


class LstmLanguageModel(nn.Module):
    def __init__(self, vocab_size: int, width: int, layers: int, dropout: float = 0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.lstm = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.drop = nn.Dropout(dropout)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.lstm(self.embed(tokens))
        return self.out(self.drop(hidden))


def lstm(table: dict) -> nn.Module:
    """The factory: [model] vocab_size, and the table's own keys `width`, `lstm_layers` and `output_dropout`."""
    return LstmLanguageModel(table["vocab_size"], table.get("width", 32), table.get("lstm_layers", 1),
                             table.get("output_dropout", 0.0))


def not_a_module(table: dict) -> dict:
    return {"weights": [1, 2, 3]}


def wrong_vocabulary(table: dict) -> nn.Module:
    return LstmLanguageModel(table["vocab_size"] - 1, 16, 1)


def raises(table: dict) -> nn.Module:
    raise KeyError("hidden_size")


def unseeded(table: dict) -> nn.Module:
    """Draws its initial weights from Python's random module: every worker would start elsewhere."""
    model = LstmLanguageModel(table["vocab_size"], 8, 1)
    with torch.no_grad():
        model.out.bias.fill_(random.random())
    return model


def frozen(table: dict) -> nn.Module:
    """Every parameter frozen: nothing to train."""
    return LstmLanguageModel(table["vocab_size"], 8, 1).requires_grad_(False)


class _IntegerLogits(LstmLanguageModel):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens).long()


def integer_logits(table: dict) -> nn.Module:
    return _IntegerLogits(table["vocab_size"], 8, 1)


class _DetachedLogits(LstmLanguageModel):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens).detach()


def detached_logits(table: dict) -> nn.Module:
    return _DetachedLogits(table["vocab_size"], 8, 1)


def partly_frozen(table: dict) -> nn.Module:
    """The embedding frozen (as fine-tuning a pretrained model's upper layers does), the rest trained."""
    model = LstmLanguageModel(table["vocab_size"], 16, 1)
    model.embed.weight.requires_grad_(False)
    return model


class ResidualStack(nn.Module):
    """Residual MLP blocks in an nn.ModuleList: blocks the engine finds without a workload."""

    def __init__(self, vocab_size: int, width: int, layers: list[nn.Module]):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, width)
        self.layers = nn.ModuleList(layers)
        self.out = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        for layer in self.layers:
            hidden = hidden + layer(hidden)
        return self.out(hidden)


def _block(width: int, dropout: float = 0.0) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout))


def shared_layers(table: dict) -> nn.Module:
    """One block applied three times (weights shared across depth, as ALBERT does)."""
    return ResidualStack(table["vocab_size"], 16, [_block(16)] * 3)


def with_dropout(table: dict) -> nn.Module:
    """Its own dropout layers in its blocks ([model] dropout is the built-in GPT's, not this model's)."""
    return ResidualStack(table["vocab_size"], 16, [_block(16, dropout=0.3) for _ in range(3)])


class _FailsWhereItTrains(LstmLanguageModel):
    """Indexes past its sequence once it trains on the workers (the driver's checks run it on the meta device,
    outside any process group): a bug every restart meets again."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if torch.distributed.is_initialized():
            return super().forward(tokens)[:, tokens.shape[1] + 3]
        return super().forward(tokens)


def fails_where_it_trains(table: dict) -> nn.Module:
    return _FailsWhereItTrains(table["vocab_size"], 8, 1)


def in_bf16(table: dict) -> nn.Module:
    return LstmLanguageModel(table["vocab_size"], 8, 1).to(torch.bfloat16)


def moved_to_a_device(table: dict) -> nn.Module:
    return LstmLanguageModel(table["vocab_size"], 8, 1).to("cpu")


class _WithAnUnusedLayer(LstmLanguageModel):
    def __init__(self, vocab_size: int):
        super().__init__(vocab_size, 8, 1)
        self.spare = nn.Linear(8, 8)  # never called in forward


def with_an_unused_layer(table: dict) -> nn.Module:
    return _WithAnUnusedLayer(table["vocab_size"])
