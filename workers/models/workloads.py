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
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor.parallel import ParallelStyle
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from core.config import ModelConfig
from core.errors import ConfigError
from core.workload import Workload
from kernels.loss import ignore_masked, plain_cross_entropy
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
FACTORY = "[model] factory"
DETERMINISM_CHECKED_UP_TO = 50_000_000
"""Parameters up to which the driver builds a custom model twice to see that one seed gives one model
(larger ones the workers compare among themselves when they start)."""


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


def factory_table(config: ModelConfig) -> dict[str, Any]:
    """What a factory is called with: the [model] table, the user's own keys among archipelago's."""
    table = dataclasses.asdict(config)
    options = table.pop("options")
    return {**table, **options}


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
    """The factory's workload once what it builds is seen to be a model of the table's vocabulary: built
    on the meta device and run on a meta batch (no weights are made), so a large model costs nothing."""
    with torch.device("meta"):
        try:
            built = factory(factory_table(config))
        except Exception as e:
            raise ConfigError(f"{config.factory} raised {type(e).__name__}: {e}", where=FACTORY,
                              fix="make the factory build its model from the [model] table it is given") from None
    if isinstance(built, Workload) and not isinstance(built, nn.Module):
        return built
    if not isinstance(built, nn.Module):
        raise ConfigError(f"{config.factory} returned a {type(built).__name__}, not an nn.Module", where=FACTORY,
                          fix="return the model (an nn.Module mapping token ids to logits), or a workload with "
                              "build, loss, blocks and identity")
    if not any(p.requires_grad for p in built.parameters()):
        count = sum(1 for _ in built.parameters())
        raise ConfigError(f"the model {config.factory} built has nothing to train: "
                          + (f"none of its {count} parameters requires a gradient" if count else "it has no parameters"),
                          where=FACTORY, fix="return a model with trainable parameters (nn.Parameter, requires_grad "
                                             "left on); freeze only part of it")
    _check_output(built, config, factory)
    if sum(p.numel() for p in built.parameters()) <= DETERMINISM_CHECKED_UP_TO:
        _check_same_weights(config, factory)
    return ModuleWorkload(config, factory)


def _check_same_weights(config: ModelConfig, factory: Callable[[dict], Any]) -> None:
    """Every worker builds the model from the same torch seed: the factory must then build the same
    weights (FSDP2 shards whatever each rank built)."""
    first, second = (_seeded_weights(config, factory) for _ in range(2))
    differ = [name for name in first if not torch.equal(first[name], second.get(name, first[name] + 1))]
    if differ or first.keys() != second.keys():
        names = ", ".join(differ[:3]) or "different parameter names"
        raise ConfigError(f"{config.factory} builds different weights from the same torch seed ({names}), so the "
                          "workers would start from different models", where=FACTORY,
                          fix="draw the initial weights from torch's random generator (archipelago seeds it with "
                              "[train] seed on every worker), not random or numpy")


def _seeded_weights(config: ModelConfig, factory: Callable[[dict], Any]) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return {name: value.detach().clone() for name, value in factory(factory_table(config)).state_dict().items()}


def _check_output(model: nn.Module, config: ModelConfig, factory: Callable[[dict], Any]) -> None:
    """The model maps a batch of token ids to logits of the table's vocabulary: run on the meta device,
    and where that cannot run it (a forward that reads a value, .item()), built again on fake tensors."""
    tokens = (2, min(config.seq_len, 8))
    try:
        logits = _forward(model, tokens)
    except Exception:  # noqa: BLE001 - an op the meta device cannot run: fake tensors decide
        try:
            with fake_tensors():
                with torch.device("meta"):
                    logits = _forward(factory(factory_table(config)), tokens)
        except Exception as e:
            said = (str(e).strip().splitlines() or [""])[0]  # torch's guard errors run on for lines
            raise ConfigError(f"the model {config.factory} built fails on a batch of token ids (batch 2, seq "
                              f"{tokens[1]}): {type(e).__name__}: {said}", where=FACTORY,
                              fix="its forward takes token ids (batch, seq) and returns logits (batch, seq, vocab), "
                                  "with no branch on a tensor's value") from None
    expected = (*tokens, config.vocab_size)
    if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != expected:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ConfigError(f"the model {config.factory} built returns {got} for token ids of shape "
                          f"{tokens}, not logits of shape {expected}", where=FACTORY,
                          fix="return logits (batch, seq, [model] vocab_size) from forward, or a workload whose "
                              "loss reads your model's output")
    if not logits.is_floating_point():
        raise ConfigError(f"the model {config.factory} built returns {logits.dtype} logits", where=FACTORY,
                          fix="return floating-point logits (fp32, or what autocast makes): the loss is taken "
                              "from them and differentiated")
    if torch.is_grad_enabled() and not logits.requires_grad:
        raise ConfigError(f"the logits the model {config.factory} built returns do not depend on its trainable "
                          "parameters: no gradient would reach them", where=FACTORY,
                          fix="compute the logits from the parameters, with no torch.no_grad(), detach() or "
                              "integer cast in forward")


def _forward(model: nn.Module, tokens: tuple[int, int]) -> Any:
    return model(torch.zeros(tokens, dtype=torch.long, device="meta"))


def fake_tensors() -> FakeTensorMode:
    """Tensors with shapes and dtypes but no values, for a model the meta device cannot run: a value it
    reads (.item()) is an unknown number, as torch.compile traces it; a branch on one still fails."""
    return FakeTensorMode(allow_non_fake_inputs=False, shape_env=ShapeEnv())


def _reference(factory: Callable) -> str:
    return f"{getattr(factory, '__module__', '?')}:{getattr(factory, '__qualname__', repr(factory))}"
