"""Hugging Face causal LMs as workloads: [model] kind = "hf".

    workload = HFWorkload.from_dir(config)        # config.json through transformers' AutoConfig, checked here
    model = workload.build()                      # AutoModelForCausalLM.from_config, initialised (weights
                                                  # come later, workers/pretrained.py, into the sharded model)

Any causal LM transformers can build from a local config.json trains: no hub access, no remote code.
The model is held by `HFCausalLM`, whose forward is the one the engine calls for every model (token
ids, targets, a loss mask, positions, the loss kernel), so DDP, FSDP2 (over its decoder layers) and
torch.compile wrap it as they wrap the built-ins. For the architectures whose logits are the output
projection of the decoder's last hidden state and nothing more (PLAIN_HEAD_TYPES), the loss runs
through archipelago's loss kernels (fused by default); other architectures take their own logits.

Packed fine-tuning samples pass `positions` as position_ids: transformers restarts the rotary positions
and, seeing them restart, keeps attention inside each document (its masking_utils finds packed
sequences from position_ids when no attention mask is given).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from core.config import ModelConfig
from core.errors import ConfigError
from core.hf_config import CONFIG_FILE, WHERE, read_hf_config
from kernels.loss import ignore_masked, plain_cross_entropy
from workers.models.hf_weights import check_shapes, safetensors_files
from workers.models.layers import repeated_layers
from workers.models.stack import head_loss

PLAIN_HEAD_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""model_type values whose logits are lm_head(decoder's last hidden state): archipelago's loss kernels
serve them. Others (soft-capped or scaled logits) take the model's own logits and the plain loss."""
VOLATILE_KEYS = ("transformers_version", "_name_or_path", "dtype", "torch_dtype", "use_cache", "architectures")
"""config.json keys that do not shape the weights: left out of the checkpoint identity."""
PREFIX = "hf."
"""Our state-dict names are the transformers model's, under HFCausalLM's attribute `hf`."""


class HFCausalLM(nn.Module):
    """A transformers causal LM behind the forward archipelago's engine calls."""

    def __init__(self, hf: nn.Module):
        super().__init__()
        self.hf = hf
        self.plain_head = hf.config.model_type in PLAIN_HEAD_TYPES

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, *, loss_mask: torch.Tensor | None = None,
                positions: torch.Tensor | None = None, loss_kernel: str = "plain") -> torch.Tensor:
        """The mean cross-entropy over the targets loss_mask keeps (all without one), else the logits."""
        if self.plain_head:
            hidden = self.hf.get_decoder()(input_ids=idx, position_ids=positions, use_cache=False).last_hidden_state
            return head_loss(hidden, self.hf.get_output_embeddings().weight, targets, loss_kernel, loss_mask=loss_mask)
        logits = self.hf(input_ids=idx, position_ids=positions, use_cache=False).logits
        if targets is None:
            return logits
        return plain_cross_entropy(logits.flatten(0, 1), ignore_masked(targets, loss_mask).flatten())


@dataclasses.dataclass(frozen=True)
class HFWorkload:
    config: ModelConfig
    hf_config: Any
    """transformers' PretrainedConfig, read on the driver (the workers get it inside the spec)."""
    name: str
    has_weights: bool
    """The directory holds *.safetensors weights (checked against the model); else the model starts initialised."""

    @classmethod
    def from_dir(cls, config: ModelConfig) -> HFWorkload:
        """The workload of `config.hf_dir`, once transformers knows its architecture as a causal LM and
        its safetensors (if any) hold every weight in the shape the config gives: ConfigError otherwise."""
        values = read_hf_config(config.hf_dir)
        path = f"{config.hf_dir}/{CONFIG_FILE}"
        if values.get("auto_map"):
            raise ConfigError(f"{path} asks for the model's own Python code (auto_map)", where=WHERE,
                              fix="archipelago runs no downloaded code: use an architecture transformers ships")
        try:
            from transformers import AutoConfig
        except ImportError as e:
            raise _transformers_missing(e) from None
        try:
            hf_config = AutoConfig.for_model(**values)
        except (ValueError, KeyError) as e:
            raise ConfigError(f"{path}: transformers does not know model_type {values['model_type']!r} ({e})",
                              where=WHERE, fix="use a causal LM architecture this transformers knows, or upgrade "
                                               "transformers") from None
        workload = cls(config, hf_config, f"hf:{values['model_type']}", bool(safetensors_files(config.hf_dir)))
        with torch.device("meta"):
            model = workload.build()
        if workload.has_weights:
            check_shapes(expected_weights(model), config.hf_dir)
        return workload

    def identity(self) -> dict[str, Any]:
        shape = {k: v for k, v in self.hf_config.to_dict().items() if k not in VOLATILE_KEYS}
        # As a checkpoint's JSON gives it back: id2label's int keys turn into strings there.
        return {"kind": "hf", "config": json.loads(json.dumps(shape)), "seq_len": self.config.seq_len}

    def build(self) -> HFCausalLM:
        from transformers import AutoModelForCausalLM

        try:
            hf = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.get_default_dtype(),
                                                  attn_implementation="sdpa")
        except ValueError as e:
            raise ConfigError(f"{self.config.hf_dir}/{CONFIG_FILE} is not a causal language model transformers "
                              f"can build ({str(e).splitlines()[0]})", where=WHERE,
                              fix="use the config.json of a causal LM (…ForCausalLM)") from None
        return HFCausalLM(hf)

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, *, loss_kernel: str = "plain",
             loss_mask: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        return model(inputs, targets, loss_mask=loss_mask, positions=positions, loss_kernel=loss_kernel)

    def blocks(self, model: nn.Module) -> Sequence[nn.Module]:
        return repeated_layers(model)


def _transformers_missing(error: ImportError) -> ConfigError:
    """Why transformers would not import: absent, or a release that needs Hugging Face's `kernels` library,
    whose import name archipelago's own `kernels` package takes."""
    if "kernels" in str(error):
        return ConfigError(f"this transformers release imports Hugging Face's `kernels` library, and archipelago's "
                           f"own `kernels` package shadows it ({error})", where=WHERE,
                           fix="pip install 'transformers>=5,<5.25' (what archipelago[hf] asks for)")
    return ConfigError('kind = "hf" needs transformers', where=WHERE, fix="pip install 'archipelago[hf]'")


def expected_weights(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The HF tensor names and shapes of the model's weights (a tied weight once, under its first name)."""
    return {name.removeprefix(PREFIX): tuple(p.shape) for name, p in model.named_parameters()}
