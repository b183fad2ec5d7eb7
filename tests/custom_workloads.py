"""More models a user might bring (beside tests/custom_models.py's LSTM): one whose forward reads a value,
one whose output hangs on a value, one seeded by its rank, and workloads of the user's own (core/workload.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.custom_models import LstmLanguageModel


class ScaledByItsLargestLogit(LstmLanguageModel):
    """Reads a value in its forward (.item()), which the meta device cannot run: a valid model all the same."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        return logits / (1.0 + logits.detach().abs().max().item())


def reads_a_value(table: dict) -> nn.Module:
    return ScaledByItsLargestLogit(table["vocab_size"], 8, 1)


class ShapeHangsOnAValue(LstmLanguageModel):
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = super().forward(tokens)
        return logits[..., :-1] if logits.sum() > 0 else logits  # one vocabulary entry short on one branch


def shape_hangs_on_a_value(table: dict) -> nn.Module:
    return ShapeHangsOnAValue(table["vocab_size"], 8, 1)


def seeded_by_rank(table: dict) -> nn.Module:
    """Seeds torch with its rank: one model on the driver (rank 0 of none), another on each worker."""
    torch.manual_seed(dist.get_rank() if dist.is_initialized() else 0)
    return LstmLanguageModel(table["vocab_size"], 8, 1)


class LabelSmoothedLstm:
    """A workload of the user's own: the LSTM trained with a label-smoothed loss."""

    name = "label-smoothed-lstm"
    smoothing = 0.1

    def __init__(self, table: dict):
        self.table = table

    def identity(self) -> dict:
        return {"kind": "custom", "factory": self.name, "vocab_size": self.table["vocab_size"],
                "smoothing": self.smoothing}

    def build(self) -> nn.Module:
        return LstmLanguageModel(self.table["vocab_size"], self.table.get("width", 32), 1)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loss_kernel: str = "plain",
             loss_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        logits = model(inputs)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), label_smoothing=self.smoothing)

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return []


def label_smoothed(table: dict) -> LabelSmoothedLstm:
    return LabelSmoothedLstm(table)


class CpuWeightedLstm(LabelSmoothedLstm):
    """A loss that weighs each token by a table it keeps on the CPU: it trains on CPU workers and fake CPU
    tensors run it (the memory estimate), but beside a meta model's logits it cannot run, so its FLOPs are
    not counted."""

    name = "cpu-weighted-lstm"

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, **_) -> torch.Tensor:
        weights = torch.ones(self.table["vocab_size"], device="cpu")
        return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), weight=weights)


def cpu_weighted(table: dict) -> CpuWeightedLstm:
    return CpuWeightedLstm(table)


class _PerTokenLoss(LabelSmoothedLstm):
    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, **_) -> torch.Tensor:
        return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(), reduction="none")


def per_token_loss(table: dict) -> _PerTokenLoss:
    return _PerTokenLoss(table)


class _BuildsNothing(LabelSmoothedLstm):
    def build(self) -> None:
        return None


def builds_nothing(table: dict) -> _BuildsNothing:
    return _BuildsNothing(table)


class _BlocksOfAnotherModel(LabelSmoothedLstm):
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        return [nn.Linear(8, 8)]


def blocks_of_another_model(table: dict) -> _BlocksOfAnotherModel:
    return _BlocksOfAnotherModel(table)


class TokenWeightedLstm(LabelSmoothedLstm):
    """Keeps a tensor made in __init__ (a weight per vocabulary entry) and moves it to the batch's device."""

    name = "token-weighted-lstm"

    def __init__(self, table: dict):
        super().__init__(table)
        self.weights = torch.linspace(0.5, 1.5, table["vocab_size"])

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, **_) -> torch.Tensor:
        return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten(),
                                           weight=self.weights.to(inputs.device))


def token_weighted(table: dict) -> TokenWeightedLstm:
    return TokenWeightedLstm(table)
