"""Quantization-aware training on CPU: the engine trains fake-quantized linear layers, and the really
quantized model, converted in place or exported for transformers, computes what they computed."""

import copy

import pytest
import torch

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator.export import write_hf
from tests.engine_support import engine_spec
from workers.engine import Engine
from workers.qat import convert_qat

SEQ = 32
QUANTIZATION_TOLERANCE = 1e-3
"""Largest logit gap, over the largest logit, between transformers' quantized model and the fake-quantized
one: the same integers, but another order of float operations can move a value across a rounding step of
the per-token activation quantization."""


def qat_engine(scheme: str) -> tuple[Engine, JobConfig]:
    config = JobConfig.from_dict({"model": {"kind": "llama", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64,
                                            "seq_len": SEQ, "tie_embeddings": False},
                                  "train": {"global_batch_size": 4, "micro_batch_size": 4, "lr": 3e-3, "qat": scheme},
                                  "cluster": {"num_workers": 1}})
    return Engine(engine_spec(config, 1, 4, 1), 0, torch.device("cpu")), config


@pytest.mark.parametrize("scheme", ["int8-dynamic-act-int4-weight", "int8-weight"])
def test_fake_quantized_training_converts_to_the_model_it_simulated(tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    engine, config = qat_engine(scheme)
    assert engine.qat_layers == 2 * 4  # wqkv, wo, w13, w2 in each block (not the head)
    torch.manual_seed(0)
    batch = torch.randint(0, 257, (4, SEQ + 1))
    losses = [float(engine([batch], lr=3e-3)[0]) for _ in range(4)]
    assert losses[-1] < losses[0]
    tokens = batch[:2, :-1]
    with torch.no_grad():
        fake = engine.model(tokens)
        plain = engine.workload.build()  # the same weights without fake quantization
        plain.load_state_dict(engine.model.state_dict())
        assert not torch.allclose(plain(tokens), fake, atol=1e-4)  # fake quantization changes the outputs
        converted = copy.deepcopy(engine.model)
        convert_qat(converted, scheme, 32)
        assert type(converted.layers[0].attention.wqkv.weight).__name__ == "IntxUnpackedToInt8Tensor"
        torch.testing.assert_close(converted(tokens), fake, rtol=0, atol=1e-5)

    write_hf(plain, config, tmp_path / "out", quantized=True)  # what `archipelago export --quantized` writes
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
    with torch.no_grad():
        gap = (exported(input_ids=tokens).logits - fake).abs().max() / fake.abs().max()
    assert gap < QUANTIZATION_TOLERANCE


def test_qat_refuses_float8_and_an_export_of_a_run_without_it(tmp_path):
    with pytest.raises(ConfigError, match=r"\[train\] qat"):
        JobConfig.from_dict({"train": {"qat": "int8-weight", "precision": "fp8"}, "cluster": {"use_gpu": True}})
    config = JobConfig.from_dict({"model": {"kind": "llama", "n_layer": 1, "n_head": 2, "n_embd": 32}})
    with pytest.raises(ConfigError, match="without quantization-aware training"):
        write_hf(torch.nn.Module(), config, tmp_path / "out", quantized=True)
    assert not (tmp_path / "out").exists()
