"""The workloads archipelago trains: the built-in GPT and Llama, a Hugging Face model, and the user's own
model from a factory.

    workload = make_workload(config.model)                 # [model] kind = "gpt" | "llama" | "hf" | "custom"
    reference = register_factory(fn)                       # the Python API: Orchestrator(config, model=fn)

A factory is called with the [model] table (a dict: archipelago's keys and the user's own) and
returns either an nn.Module whose forward takes token ids (batch, seq) and returns logits
(batch, seq, vocab), or a workload (core/workload.py) of its own when the model needs its own loss
or block list. Everything that can be known about a factory before a worker starts is checked
here, on the driver, with a ConfigError naming `[model] factory` and the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ParallelStyle

from core.config import ModelConfig
from core.errors import ConfigError
from core.workload import Workload
from kernels.loss import ignore_masked, plain_cross_entropy
from workers.models.factory_checks import FACTORY, call_factory, check_model, check_workload, factory_table
from workers.models.gpt import GPT
from workers.models.hf import HFWorkload
from workers.models.hf_weights import check_shapes, expected_shapes, llama_layout, safetensors_files
from workers.models.layers import repeated_layers
from workers.models.llama import Llama
from workers.models.stack import BlockStack

GPT_IDENTITY = ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size", "dropout", "bias", "stacked_rows")
"""What a gpt checkpoint records of its model (the keys every gpt checkpoint has had, and stacked_rows)."""
LLAMA_IDENTITY = ("kind", "n_layer", "n_head", "n_kv_head", "n_embd", "ffn_dim", "seq_len", "vocab_size",
                  "rope_theta", "rope_scaling", "tie_embeddings", "norm_eps", "stacked_rows", "qkv_bias")
RECORDED_WHEN_SET = ("qkv_bias",)
"""Identity keys added later, recorded only when set: checkpoints from before them were made without
them (and were all unset), so they still resume."""
STACKED_ROWS = "by head"
"""How the stacked projections order their rows (qkv and wqkv head by head or key/value group by group,
w13 gate and up interleaved): checkpoints from before, whose rows ran q, k, v and gate, up in blocks,
hold the same shapes with other meanings, and are refused instead of loaded."""


class BuiltinWorkload:
    """The gpt and llama kinds: a BlockStack sized by [model]."""

    def __init__(self, config: ModelConfig, model_class: type[BlockStack], identity_keys: Sequence[str]):
        self.config = config
        self.name = config.kind
        self._model_class = model_class
        self._identity_keys = identity_keys

    def identity(self) -> dict[str, Any]:
        values = dataclasses.asdict(self.config)
        values["n_kv_head"], values["ffn_dim"] = self.config.kv_heads, self.config.hidden_dim
        values["stacked_rows"] = STACKED_ROWS
        return {key: values[key] for key in self._identity_keys if values[key] or key not in RECORDED_WHEN_SET}

    def build(self) -> BlockStack:
        return self._model_class(self.config)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loss_kernel: str = "plain",
             loss_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return model(inputs, targets, loss_mask=loss_mask, positions=positions, loss_kernel=loss_kernel)

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return list(model.blocks)

    def tensor_parallel_plan(self, model: BlockStack) -> dict[str, list[ParallelStyle]]:
        """How each module splits over a tensor-parallel group (workers/tensor_parallel.py applies it)."""
        return model.tensor_parallel_plan()

    def tie_weights(self, model: BlockStack) -> None:
        model.tie_weights()

    def __repr__(self) -> str:  # the memory estimate's cache key
        return f"{type(self).__name__}({self.identity()!r})"


class ModuleWorkload:
    """A factory's nn.Module that maps token ids to logits: cross-entropy over them is its loss, and its
    largest list of same-kind layers its blocks (none: FSDP2 shards it whole, nothing is checkpointed)."""

    def __init__(self, config: ModelConfig, factory: Callable[[dict], Any]):
        self.config = config
        self.factory = factory
        self.name = config.factory or _reference(factory)

    def identity(self) -> dict[str, Any]:
        return {"kind": "custom", "factory": self.name, "seq_len": self.config.seq_len,
                "vocab_size": self.config.vocab_size, **self.config.options}

    def build(self) -> nn.Module:
        return self.factory(factory_table(self.config))

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loss_kernel: str = "plain",
             loss_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Cross-entropy of the logits over the targets loss_mask keeps. The model sees token ids only:
        positions (packed documents) cannot reach it, so its attention crosses packed documents."""
        logits = model(inputs)
        return plain_cross_entropy(logits.flatten(0, 1), ignore_masked(targets, loss_mask).flatten())

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return repeated_layers(model)

    def __repr__(self) -> str:
        return f"ModuleWorkload({self.identity()!r})"


def make_workload(config: ModelConfig) -> Workload:
    """The workload of the [model] table, made once per table. A custom factory is imported (or taken
    from those the Python API registered) and its model checked here: a ConfigError otherwise."""
    key = repr(config)
    if key not in _WORKLOADS:
        _WORKLOADS[key] = _make(config)
    return _WORKLOADS[key]


def adopt_workload(config: ModelConfig, workload: Workload) -> None:
    """Takes `workload`, made in the driver, as the [model] table's in this process (a Ray actor of the
    driver's): a factory the Python API was handed, defined in the driver's own script, travels pickled
    inside the workload but cannot be imported here by the name the table gives it."""
    _WORKLOADS[repr(config)] = workload


_WORKLOADS: dict[str, Workload] = {}
_REGISTERED: dict[str, Callable[[dict], Any]] = {}
"""Factories the Python API was handed as callables, by the reference that names them in [model] factory."""


def register_factory(factory: Callable[[dict], Any]) -> str:
    """Makes a callable factory (Orchestrator(config, model=fn)) what [model] factory names: returns the
    reference to write there. The callable itself reaches the workers inside their spec's workload."""
    if not callable(factory):
        raise ConfigError(f"{factory!r} is not callable", where=FACTORY,
                          fix="pass a function that takes the [model] table and returns an nn.Module")
    reference = _reference(factory)
    _REGISTERED[reference] = factory
    _WORKLOADS.clear()  # a table naming it may have been made with another callable of that name
    return reference


def _make(config: ModelConfig) -> Workload:
    if config.kind == "gpt":
        return BuiltinWorkload(config, GPT, GPT_IDENTITY)
    if config.kind == "llama":
        if config.hf_dir and safetensors_files(config.hf_dir):
            _check_llama_weights(config)
        return BuiltinWorkload(config, Llama, LLAMA_IDENTITY)
    if config.kind == "hf":
        return HFWorkload.from_dir(config)
    factory = _REGISTERED.get(config.factory) or import_factory(config.factory)
    if not callable(factory):
        raise ConfigError(f"{config.factory!r} is not callable", where=FACTORY,
                          fix="name a function that takes the [model] table and returns an nn.Module")
    return checked(config, factory)


def _check_llama_weights(config: ModelConfig) -> None:
    """hf_dir's safetensors hold every tensor the built-in Llama of its config.json stacks, in the right shape."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in Llama(config).named_parameters()}
    check_shapes(expected_shapes(llama_layout(config), shapes), config.hf_dir)


def check_takes_loss_masks(workload: Workload) -> None:
    """A fine-tuning dataset's loss mask and positions can reach the workload's loss; ConfigError otherwise."""
    parameters = inspect.signature(workload.loss).parameters
    if not {"loss_mask", "positions"} <= parameters.keys():
        raise ConfigError(f"the workload {workload.name}'s loss takes no loss_mask and positions, which a "
                          "fine-tuning dataset (prepare --format chat|instruction) needs", where=FACTORY,
                          fix="add the keyword arguments loss_mask=None, positions=None to its loss "
                              "(core/workload.py says what they hold), or return an nn.Module from the factory")


def import_factory(reference: str) -> Callable[[dict], Any]:
    """The function "package.module:function" names; ConfigError when it cannot be had."""
    module_name, _, attribute = reference.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{reference!r} is not package.module:function", where=FACTORY,
                          fix='write it as factory = "my_models.lstm:build" (a module the job can import, then ":" '
                              "and the function)")
    try:
        target: Any = _import(module_name)
    except Exception as e:  # the user's module: anything it raises while importing is theirs to fix
        raise ConfigError(f"cannot import {module_name!r}: {type(e).__name__}: {e}", where=FACTORY,
                          fix="install the module or run from the directory that holds it (fit ships it to the "
                              "workers), and fix the error it raises on import") from None
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise ConfigError(f"{module_name!r} has no {attribute!r}", where=FACTORY,
                              fix=f"name a function defined in {module_name}")
        target = getattr(target, name)
    return target


def _import(module_name: str) -> ModuleType:
    """The module, looked for in the working directory too: `archipelago fit` runs as a console script,
    whose path starts at its own bin directory, not where the user keeps the job and its model."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name.split(".")[0] or os.getcwd() in sys.path:
            raise
    sys.path.append(os.getcwd())
    return importlib.import_module(module_name)


def checked(config: ModelConfig, factory: Callable[[dict], Any]) -> Workload:
    """The factory's workload once what it builds is seen to train: built on the meta device and run on a meta
    batch (no weights are made), so a large model costs nothing (workers/models/factory_checks.py)."""
    built = call_factory(config, factory)
    if isinstance(built, Workload) and not isinstance(built, nn.Module):
        check_workload(config, built)
        # Called again off the meta device: the workload travels to the workers with what its __init__ made.
        return factory(factory_table(config))
    check_model(config, factory, built)
    return ModuleWorkload(config, factory)


def _reference(factory: Callable) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"
