"""Bad Hugging Face input is refused before anything starts, with the file and the fix: a directory
without config.json, an architecture transformers does not know, safetensors of another shape, and the
built-in Llama asked to take Qwen2's biased projections. Nothing is written into the run directory. And good
input streams into FSDP2 shards: each rank reads its part, and the sharded model computes transformers' loss."""

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


def test_the_built_in_llama_refuses_qwen2s_biases(tmp_path):
    write_model(tmp_path / "q", "qwen2", weights=False)
    error = refused(tmp_path, tmp_path / "q", "llama")
    assert "Qwen2" in error.what and "biases" in error.what and 'kind = "hf"' in error.what


def sharded_losses(rank: int, world: int, hf_dir: str) -> dict:
    """On each rank of an FSDP2 group: hf_dir's weights read into this rank's shards (kind hf through
    DCP's HuggingFaceStorageReader, the built-in through row reads), then the loss of one batch; and
    the built-in split by tensor parallelism (row-wise layers sharded by columns)."""
    from storage.checkpoint_io import checkpoint_group
    from workers.engine import Engine
    from workers.pretrained import load_pretrained

    torch.manual_seed(0)
    batch = torch.randint(0, 320, (2, 33))
    losses = {}
    for kind, tensor_parallel_size in (("hf", 1), ("llama", 1), ("llama", 2)):
        config = JobConfig.from_dict({"model": {"kind": kind, "hf_dir": hf_dir, "seq_len": 32},
                                      "parallel": {"strategy": "fsdp"}, "train": {"global_batch_size": 4,
                                                                                  "micro_batch_size": 2}})
        spec = uniform_spec(config, world_size=world, micro_batch_size=2, grad_accum_steps=1,
                            tensor_parallel_size=tensor_parallel_size)
        engine = Engine(spec, rank, torch.device("cpu"))
        shard = next(p for p in engine.model.parameters() if p.dim() == 2)
        assert shard.to_local().shape[0] < shard.shape[0]  # sharded: each rank reads a part of each tensor
        assert load_pretrained(engine.model, config.model, process_group=checkpoint_group())
        with torch.no_grad(), engine.wrapped.loss_context():
            loss = engine.workload.loss(engine.model, batch[:, :-1], batch[:, 1:])
        losses[kind if tensor_parallel_size == 1 else f"{kind} tp{tensor_parallel_size}"] = float(
            loss.full_tensor() if isinstance(loss, DTensor) else loss)
    return losses


def test_weights_stream_into_fsdp2_and_tensor_parallel_shards(tmp_path):
    from tests.engine_support import run_ranks
    from tests.hf_support import hf_loss

    model = write_model(tmp_path, "llama")
    torch.manual_seed(0)
    expected = hf_loss(model, torch.randint(0, 320, (2, 33)))
    losses = run_ranks(2, sharded_losses, str(tmp_path))
    assert all(loss == pytest.approx(expected, rel=1e-5) for loss in losses.values()) and len(losses) == 3
