"""Every job in examples/ loads and builds the model its comment promises (on the meta device: no weights
are made), counted to the parameter against the shape it names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.config import JobConfig
from workers.models import make_workload

EXAMPLES = Path(__file__).parents[2] / "examples"
PARAMETERS = {
    # GPT-2: token (vocab) and position (seq_len) embeddings, 12·d² a layer, two norms a layer and a final one,
    # no biases (the 124M shape less its biases, with 320 tokens)
    "cpu-tiny.toml": ("gpt", (257 + 128) * 128 + 4 * (12 * 128**2 + 2 * 128) + 128),
    "h200x2-gpt2-124m.toml": ("gpt", (320 + 1024) * 768 + 12 * (12 * 768**2 + 2 * 768) + 768),
    # Llama: a tied embedding; a layer's q, k and v (2 key/value heads of 32), o, SwiGLU's 3 · 384 · d and two norms
    "llama-tiny-cpu.toml": ("llama", 257 * 128 + 4 * ((128 + 2 * 64) * 128 + 128**2 + 3 * 384 * 128 + 2 * 128) + 128),
    "llama3-1b-h200.toml": ("llama", 1_235_814_400),  # Llama-3.2-1B as published
}


def test_every_example_has_its_parameter_count_here():
    assert sorted(p.name for p in EXAMPLES.glob("*.toml")) == sorted(PARAMETERS)


@pytest.mark.parametrize("example", sorted(PARAMETERS))
def test_an_example_builds_the_model_it_names(example):
    config = JobConfig.from_toml(EXAMPLES / example)
    kind, parameters = PARAMETERS[example]
    with torch.device("meta"):
        model = make_workload(config.model).build()
    assert config.name == Path(example).stem and config.model.kind == kind
    assert sum(p.numel() for p in model.parameters()) == parameters  # a tied weight once
