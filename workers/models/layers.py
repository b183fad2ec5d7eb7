"""The repeated layers of a model archipelago did not write: what FSDP2 shards and compiles one by one."""

from __future__ import annotations

import torch.nn as nn
from torch.nn.modules.dropout import _DropoutNd


def repeated_layers(model: nn.Module) -> list[nn.Module]:
    """The largest (by parameters) nn.ModuleList whose layers are all of one type: a transformer's
    decoder layers; none for a model without such a list (FSDP2 then shards it whole). A layer the list
    holds more than once (weights shared across depth, as ALBERT does) is one block: FSDP2 shards a
    module once."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)
             and len({type(layer) for layer in m}) == 1]
    largest = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=[])
    return list({id(layer): layer for layer in largest}.values())


def draws_random_numbers(model: nn.Module, dropout: float) -> bool:
    """Whether training `model` draws random numbers: [model] dropout (the built-in GPT's) or a dropout layer
    of its own. A compiled step then cannot equal an eager one (Inductor draws its own masks)."""
    return dropout > 0 or any(isinstance(m, _DropoutNd) and m.p > 0 for m in model.modules())
