"""What the driver checks of a custom factory before any worker starts: each a ConfigError naming `[model] factory`
and the fix, instead of a traceback from the planner or a failure the workers would meet (and Ray retry).

    built = call_factory(config, factory)       # on the meta device: no weights are made
    check_model(config, factory, built)         # an nn.Module: its logits, gradients, dtype, seed
    check_workload(config, built)               # a workload of the user's own: its model, loss and blocks
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from core.config import ModelConfig
from core.errors import ConfigError
from core.workload import Workload

FACTORY = "[model] factory"
DETERMINISM_CHECKED_UP_TO = 50_000_000
"""Parameters up to which the driver builds a custom model twice to see that one seed gives one model
(larger ones the workers compare among themselves when they start)."""
CHECK_TOKENS = (2, 8)
"""The batch (samples, positions at most) a factory's model is run on."""


def factory_table(config: ModelConfig) -> dict[str, Any]:
    """What a factory is called with: the [model] table, the user's own keys among archipelago's."""
    table = dataclasses.asdict(config)
    options = table.pop("options")
    return {**table, **options}


def call_factory(config: ModelConfig, factory: Callable[[dict], Any]) -> Any:
    """What the factory returns for the [model] table, made on the meta device."""
    with torch.device("meta"):
        try:
            return factory(factory_table(config))
        except Exception as e:
            if "Cannot copy out of meta tensor" in str(e):  # .to(device) or .cuda() of what it made
                raise ConfigError(f"{config.factory} moves the model it builds to a device (on the meta device "
                                  "torch cannot copy it)", where=FACTORY,
                                  fix="build the model on torch's current device: leave out .to(device), .cuda() and "
                                      "device= (archipelago puts it on each worker's device)") from None
            raise ConfigError(f"{config.factory} raised {type(e).__name__}: {e}", where=FACTORY,
                              fix="make the factory build its model from the [model] table it is given") from None


def check_model(config: ModelConfig, factory: Callable[[dict], Any], built: Any) -> None:
    """An nn.Module with trainable fp32 parameters that maps token ids to logits of the table's vocabulary,
    every trainable parameter reached by a gradient, and the same weights from the same seed."""
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
    _check_fp32(built, config.factory)
    model, logits = _check_output(built, config, factory)
    _check_gradients_reach(model, logits, config.factory)
    if sum(p.numel() for p in built.parameters()) <= DETERMINISM_CHECKED_UP_TO:
        _check_same_weights(config, factory)


def _check_fp32(model: nn.Module, name: str) -> None:
    cast = next((f"{n} is {p.dtype}" for n, p in model.named_parameters()
                 if p.is_floating_point() and p.dtype != torch.float32), None)
    if cast:
        raise ConfigError(f"the model {name} built is not in fp32 ({cast})", where=FACTORY,
                          fix="build it in fp32, without .to(dtype), .half() or .bfloat16(): archipelago keeps fp32 "
                              "weights and trains in [train] precision (bf16 autocast, or bf16_weights = true)")


def _check_gradients_reach(model: nn.Module, logits: torch.Tensor, name: str) -> None:
    """Every trainable parameter gets a gradient from the logits: DDP refuses a step that leaves one without."""
    if not logits.requires_grad:  # checked with gradients off: nothing to follow
        return
    logits.float().sum().backward()
    unused = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    if unused:
        more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
        raise ConfigError(f"the model {name} built has trainable parameters its forward does not use "
                          f"({', '.join(unused[:3])}{more}): no gradient reaches them", where=FACTORY,
                          fix="freeze them (requires_grad_(False)) or leave them out of the model")


def check_workload(config: ModelConfig, workload: Workload) -> None:
    """A workload's build() makes an nn.Module, its blocks are distinct modules of that model, and its loss of a
    batch is a differentiable scalar: run on the meta device, or where that cannot run it, on fake CPU tensors
    (as the memory estimate runs it)."""
    where = f"the workload {config.factory} returned"
    seq = min(config.seq_len, CHECK_TOKENS[1])
    loss = _on_meta_then_fake(lambda device: _workload_loss(workload, config, where, device), lambda said: ConfigError(
        f"{where}: its loss fails on a batch of token ids (batch {CHECK_TOKENS[0]}, seq {seq}): {said}", where=FACTORY,
        fix="compute the loss from the model and the batch (a tensor the workload keeps moved to the batch's device), "
            "with no branch on a tensor's value"))
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point() or not loss.requires_grad:
        got = (f"a {list(loss.shape)} {loss.dtype} tensor" + ("" if loss.requires_grad else " that no gradient reaches")
               if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}")
        raise ConfigError(f"{where}: its loss is {got}, not a scalar to differentiate", where=FACTORY,
                          fix="return the mean loss over the batch, a 0-dimensional floating-point tensor computed "
                              "from the model's parameters")


def _on_meta_then_fake(attempt: Callable[[str], Any], failed: Callable[[str], ConfigError]) -> Any:
    """attempt(device) on the meta device (nothing is allocated), and where the meta device cannot run it (a value
    read with .item(), a tensor the user's code keeps on the CPU) again on fake CPU tensors, as the memory estimate
    runs the model; what fake tensors raise becomes failed("Type: first line"). A ConfigError passes as it is."""
    try:
        return attempt("meta")
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - an op the meta device cannot run: fake tensors decide
        try:
            with fake_tensors():
                return attempt("cpu")
        except ConfigError:
            raise
        except Exception as e:  # the user's code: whatever it raises on a batch is theirs to fix
            said = (str(e).strip().splitlines() or [""])[0]  # torch's guard errors run on for lines
            raise failed(f"{type(e).__name__}: {said}") from None


def _workload_loss(workload: Workload, config: ModelConfig, where: str, device: str) -> Any:
    with torch.device(device):
        model = workload.build()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"{where}: its build() made a {type(model).__name__}, not an nn.Module", where=FACTORY,
                          fix="make build() return the model, initialised on torch's current device")
    _check_blocks(model, list(workload.blocks(model)), where)
    tokens = torch.zeros((CHECK_TOKENS[0], min(config.seq_len, CHECK_TOKENS[1]) + 1), dtype=torch.long, device=device)
    return workload.loss(model, tokens[:, :-1], tokens[:, 1:])


def _check_blocks(model: nn.Module, blocks: list, where: str) -> None:
    inside = {id(m) for m in model.modules()}
    stray = next((i for i, block in enumerate(blocks) if not isinstance(block, nn.Module) or id(block) not in inside), None)
    if stray is not None:
        raise ConfigError(f"{where}: block {stray} of its blocks(model) is not a module of the model", where=FACTORY,
                          fix="return the model's own layers (e.g. list(model.layers)): FSDP2 shards and compiles them")
    if len({id(block) for block in blocks}) != len(blocks):
        raise ConfigError(f"{where}: its blocks(model) names a module more than once", where=FACTORY,
                          fix="list each layer once, also one shared across depth: FSDP2 shards a module once")


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


def _check_output(model: nn.Module, config: ModelConfig, factory: Callable[[dict], Any]) -> tuple[nn.Module, Any]:
    """The model maps a batch of token ids to logits of the table's vocabulary (where the meta device cannot run
    it, built again on fake tensors). Returns the model that ran and its logits."""
    tokens = (CHECK_TOKENS[0], min(config.seq_len, CHECK_TOKENS[1]))

    def attempt(device: str) -> tuple[nn.Module, Any]:
        built = model if device == "meta" else factory(factory_table(config))  # the meta one is made already
        return built, built(torch.zeros(tokens, dtype=torch.long, device=device))

    model, logits = _on_meta_then_fake(attempt, lambda said: ConfigError(
        f"the model {config.factory} built fails on a batch of token ids (batch {tokens[0]}, seq {tokens[1]}): {said}",
        where=FACTORY, fix="its forward takes token ids (batch, seq) and returns logits (batch, seq, vocab), with no "
                           "branch on a tensor's value"))
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
    return model, logits


def fake_tensors() -> FakeTensorMode:
    """Tensors with shapes and dtypes but no values, for a model the meta device cannot run: a value it
    reads (.item()) is an unknown number, as torch.compile traces it; a branch on one still fails. A real tensor
    the user's code keeps (a workload's table of token weights) joins them as a fake one."""
    return FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv())
