"""Quantization-aware training through torchao: fake-quantized linear layers while training, real
quantized ones at export.

    layers = prepare_qat(model, blocks, "int8-dynamic-act-int4-weight", group_size=32)   # before wrapping
    convert_qat(model, scheme, group_size)          # the real quantized model of what QAT trained
    quantize_ptq(model, blocks, scheme, group_size) # the same quantization without QAT (archipelago export
                                                    # --quantized, and the baseline QAT must beat)

Schemes ([train] qat), torchao 0.18's QATConfig over a post-training config:
- "int8-dynamic-act-int4-weight": activations int8 per token (asymmetric, quantized on the fly), weights
  int4 per group of `group_size` input features (symmetric): Int8DynamicActivationIntxWeightConfig.
- "int8-weight": weights int8 per output row (symmetric), activations as they are: IntxWeightOnlyConfig.
Fake quantization rounds in the forward and passes gradients straight through (torchao's
FakeQuantizedLinear); the parameter names do not change, so checkpoints, resume and export read them
as usual. The converted layers hold torchao's int8-unpacked tensors and compute what the fake-quantized
ones computed (equal on CPU in tests/unit/test_qat.py). The linear layers of the workload's blocks
only: the embeddings and the output projection (whose weight the loss kernels read directly) keep full
precision, as does a layer whose input width the group does not divide.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.errors import ConfigError

SCHEMES = ("int8-dynamic-act-int4-weight", "int8-weight")


def base_config(scheme: str, group_size: int):
    """torchao's post-training config of a [train] qat scheme."""
    try:
        from torchao.quantization import Int8DynamicActivationIntxWeightConfig, IntxWeightOnlyConfig
        from torchao.quantization.granularity import PerAxis, PerGroup
    except ImportError:
        raise ConfigError("quantization-aware training needs torchao", where="[train] qat",
                          fix="pip install 'archipelago[qat]'") from None
    if scheme == "int8-dynamic-act-int4-weight":
        return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=PerGroup(group_size))
    if scheme == "int8-weight":
        return IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=PerAxis(0))
    raise ConfigError(f"{scheme!r} is not a QAT scheme", where="[train] qat", fix=f"use one of {', '.join(SCHEMES)}")


def prepare_qat(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], scheme: str, group_size: int) -> int:
    """Makes the blocks' linear layers fake-quantized in place; returns how many."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    chosen = _eligible(blocks, group_size)
    quantize_(model, QATConfig(base_config(scheme, group_size), step="prepare"), filter_fn=lambda m, fqn: id(m) in chosen)
    return len(chosen)


def convert_qat(model: torch.nn.Module, scheme: str, group_size: int) -> None:
    """The fake-quantized layers prepare_qat made become really quantized ones, in place."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig

    quantize_(model, QATConfig(base_config(scheme, group_size), step="convert"))


def quantize_ptq(model: torch.nn.Module, blocks: Sequence[torch.nn.Module], scheme: str, group_size: int) -> None:
    """Post-training quantization of the layers prepare_qat would choose, in place."""
    from torchao.quantization import quantize_

    chosen = _eligible(blocks, group_size)
    quantize_(model, base_config(scheme, group_size), filter_fn=lambda m, fqn: id(m) in chosen)


def _eligible(blocks: Sequence[torch.nn.Module], group_size: int) -> set[int]:
    """ids of the blocks' linear layers whose input width the group divides."""
    return {id(m) for block in blocks for m in block.modules()
            if isinstance(m, torch.nn.Linear) and m.in_features % group_size == 0}
