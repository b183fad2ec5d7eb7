"""Bad Hugging Face input is refused before anything starts, with the file and the fix: a directory
without config.json, an architecture transformers does not know, safetensors of another shape, and the
built-in Llama asked to take a Llama's o_proj bias or a window shorter than seq_len. Nothing is written
into the run directory. Good input streams into FSDP2 and tensor-parallel shards: each rank reads its
part, and the sharded model computes transformers' loss (Llama, Qwen2 and Mistral directories as
`kind = "hf"`; Llama and Qwen2 in the built-in), Qwen2's q, k and v biases included; the
built-in exports back to the Qwen2ForCausalLM of its logits."""

import json
import sys
import types

import pytest
import torch
from torch.distributed.tensor import DTensor

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator import Orchestrator
from planning.resolve import uniform_spec
from tests.conftest import tiny_job
from tests.hf_support import write_model
from workers.models import make_workload


def hf_job(tmp_path, hf_dir, kind="hf"):
    config = tiny_job(tmp_path / "data", tmp_path / "runs", model={"seq_len": 32})
    return JobConfig.from_dict({**config.to_dict(), "model": {"kind": kind, "hf_dir": str(hf_dir), "seq_len": 32}})


def refused(tmp_path, hf_dir, kind="hf") -> ConfigError:
    with pytest.raises(ConfigError) as raised:
        Orchestrator(hf_job(tmp_path, hf_dir, kind)).fit()
    assert not (tmp_path / "runs").exists()
    return raised.value


def test_a_directory_without_config_json(tmp_path):
    (tmp_path / "empty").mkdir()
    error = refused(tmp_path, tmp_path / "empty")
    assert "empty/config.json does not exist" in error.what and "config.json" in error.fix


def test_an_architecture_transformers_does_not_know(tmp_path):
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text(json.dumps({"model_type": "llamazilla", "vocab_size": 300}))
    error = refused(tmp_path, tmp_path / "odd")
    assert "odd/config.json" in error.what and "llamazilla" in error.what and "transformers" in error.fix


class TransformersNeedingHubKernels(types.ModuleType):
    """What transformers 5.25 does on import: reaches for Hugging Face's `kernels`, and finds ours."""

    def __getattr__(self, name):
        raise ImportError("cannot import name 'CUDAProperties' from 'kernels' (archipelago/kernels/__init__.py)")


@pytest.mark.parametrize("installed, said", [(None, "needs transformers"),
                                             (TransformersNeedingHubKernels("transformers"), "shadows it")])
def test_a_transformers_that_will_not_import_is_named(tmp_path, monkeypatch, installed, said):
    write_model(tmp_path / "m", "llama")
    monkeypatch.setitem(sys.modules, "transformers", installed)
    error = refused(tmp_path, tmp_path / "m")
    assert said in error.what and "archipelago[hf]" in error.fix


def test_safetensors_of_another_shape(tmp_path):
    write_model(tmp_path / "m", "llama")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    for kind in ("hf", "llama"):
        error = refused(tmp_path, tmp_path / "m", kind)
        assert "model.safetensors" in error.what and "[64, 32]" in error.what and "[96, 32]" in error.what
        assert "config.json" in error.fix


def test_a_shard_the_index_names_but_the_directory_lacks_is_named(tmp_path):
    write_model(tmp_path / "m", "llama")
    (tmp_path / "m" / "model.safetensors").rename(tmp_path / "m" / "model-00001-of-00002.safetensors")
    weight_map = {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                  "lm_head.weight": "model-00002-of-00002.safetensors"}
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    error = refused(tmp_path, tmp_path / "m", "llama")
    assert error.what.endswith(f"names model-00002-of-00002.safetensors, which is not in {tmp_path / 'm'}")
    assert "download the missing safetensors files" in error.fix


@pytest.mark.parametrize("dtype", [torch.int64, torch.float8_e4m3fn])
def test_safetensors_holding_integers_or_float8_where_weights_belong(tmp_path, dtype):
    """An integer tensor of the right shape was cast to weights without a word (the first loss changed), and so
    would a float8 one, whose scales are in other tensors."""
    from safetensors.torch import load_file, save_file

    write_model(tmp_path / "m", "llama")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(path)
    key = "model.layers.0.mlp.up_proj.weight"
    tensors[key] = tensors[key].round().to(dtype)
    save_file(tensors, path, metadata={"format": "pt"})
    for kind in ("hf", "llama"):
        error = refused(tmp_path, tmp_path / "m", kind)
        assert f"tensor '{key}' holds {dtype} numbers, not bf16, fp16 or fp32 weights" in error.what


@pytest.mark.parametrize("architecture, overrides, said", [
    ("llama", {"attention_bias": True}, "biases on o_proj too"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16}, "sliding-window attention over 16 tokens")])
def test_the_built_in_llama_refuses_what_it_would_compute_otherwise(tmp_path, architecture, overrides, said):
    write_model(tmp_path / "m", architecture, weights=False, **overrides)
    error = refused(tmp_path, tmp_path / "m", "llama")
    assert said in error.what and 'kind = "hf"' in error.what


@pytest.mark.parametrize("kind, first", [("hf", "model.layers.0.mlp.up_proj.weight"),
                                         ("llama", "layers.0.feed_forward.w13.weight")])
def test_pretrained_weights_holding_nan_are_refused_naming_the_first(tmp_path, kind, first):
    """They trained a run of NaN losses to its end, with an alert every step."""
    from safetensors.torch import load_file, save_file

    from workers.pretrained import load_pretrained

    write_model(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    config = JobConfig.from_dict({"model": {"kind": kind, "hf_dir": str(tmp_path), "seq_len": 32}}).model
    with pytest.raises(ConfigError) as refused:
        load_pretrained(make_workload(config).build(), config)
    assert refused.value.what == f"the pretrained weights hold NaN or infinity (first: {first})"
    assert refused.value.where == f"[model] hf_dir = {tmp_path}"


def test_the_built_in_llama_computes_qwen2s_logits(tmp_path):
    """Qwen2's q, k and v biases stack into wqkv's bias in its rows' order (grouped, q and k turned
    to interleaved pairs): the built-in computes transformers' logits, and without the biases it does not."""
    from workers.pretrained import load_pretrained

    hf = write_model(tmp_path, "qwen2")
    config = JobConfig.from_dict({"model": {"kind": "llama", "hf_dir": str(tmp_path), "seq_len": 32}}).model
    assert config.qkv_bias  # from config.json's model_type
    model = make_workload(config).build()
    assert load_pretrained(model, config)
    tokens = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(input_ids=tokens).logits
        torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)
        for layer in model.layers:
            layer.attention.wqkv.bias.zero_()
        assert (model(tokens) - expected).abs().max() > 1e-2  # the biases are what made them equal


@pytest.mark.parametrize("from_hf_dir", [True, False])
def test_a_built_in_with_qkv_biases_exports_to_the_qwen2_of_its_logits(tmp_path, from_hf_dir):
    """From a Qwen2 hf_dir, or trained from scratch with qkv_bias: `archipelago export` writes a
    Qwen2ForCausalLM that transformers loads with the built-in's logits (trained biases, not zeros)."""
    from transformers import AutoModelForCausalLM

    from orchestrator.export import write_hf

    write_model(tmp_path / "hf", "qwen2")
    table = {"hf_dir": str(tmp_path / "hf")} if from_hf_dir else {"n_layer": 2, "n_head": 4, "n_kv_head": 2,
                                                                    "n_embd": 32, "qkv_bias": True}
    config = JobConfig.from_dict({"model": {"kind": "llama", "seq_len": 32, **table}})
    torch.manual_seed(3)
    model = make_workload(config.model).build()  # other weights than those in hf_dir: the trained ones
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.bias.normal_(std=0.5)
    write_hf(model, config, tmp_path / "out")
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    tokens = torch.randint(0, 257, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=tokens).logits, model(tokens), rtol=1e-5, atol=1e-5)


RUNS = (("llama", "hf", 1), ("qwen2", "hf", 1), ("mistral", "hf", 1), ("llama", "llama", 1), ("llama", "llama", 2),
        ("qwen2", "llama", 1), ("qwen2", "llama", 2))
"""(architecture of hf_dir, [model] kind, tensor_parallel_size) of each sharded loss."""


def sharded_losses(rank: int, world: int, hf_dirs: dict[str, str]) -> dict:
    """On each rank of an FSDP2 group: hf_dir's weights read into this rank's shards (kind hf through
    DCP's HuggingFaceStorageReader, the built-in through row reads), then the loss of one batch; and
    the built-in split by tensor parallelism (row-wise layers sharded by columns, Qwen2's bias by rows
    as its column-wise weight)."""
    from storage.checkpoint_io import checkpoint_group
    from workers.engine import Engine
    from workers.pretrained import load_pretrained

    torch.manual_seed(0)
    batch = torch.randint(0, 320, (2, 33))
    losses = {}
    for architecture, kind, tensor_parallel_size in RUNS:
        config = JobConfig.from_dict({"model": {"kind": kind, "hf_dir": hf_dirs[architecture], "seq_len": 32},
                                      "parallel": {"strategy": "fsdp"}, "train": {"global_batch_size": 4,
                                                                                  "micro_batch_size": 2}})
        spec = uniform_spec(config, world_size=world, micro_batch_size=2, grad_accum_steps=1,
                            tensor_parallel_size=tensor_parallel_size)
        engine = Engine(spec, rank, torch.device("cpu"))
        # Sharded by rows, Qwen2's bias with its weight: each rank reads a part of each tensor.
        for name, shard in engine.model.named_parameters():
            if name.endswith(("embed_tokens.weight", "tok_embeddings.weight", "wqkv.weight", "wqkv.bias")):
                assert shard.to_local().shape[0] < shard.shape[0], name
        assert load_pretrained(engine.model, config.model, process_group=checkpoint_group())
        with torch.no_grad(), engine.wrapped.loss_context():
            loss = engine.workload.loss(engine.model, batch[:, :-1], batch[:, 1:])
        losses[f"{architecture} as {kind} tp{tensor_parallel_size}"] = float(
            loss.full_tensor() if isinstance(loss, DTensor) else loss)
    return losses


def test_weights_stream_into_fsdp2_and_tensor_parallel_shards(tmp_path):
    from tests.engine_support import run_ranks
    from tests.hf_support import hf_loss

    torch.manual_seed(0)
    batch = torch.randint(0, 320, (2, 33))
    expected = {architecture: hf_loss(write_model(tmp_path / architecture, architecture), batch)
                for architecture in ("llama", "qwen2", "mistral")}
    losses = run_ranks(2, sharded_losses, {architecture: str(tmp_path / architecture) for architecture in expected})
    assert len(losses) == len(RUNS)
    for run, loss in losses.items():
        assert loss == pytest.approx(expected[run.split()[0]], rel=1e-5), run
