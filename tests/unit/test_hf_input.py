"""Bad Hugging Face input is refused before anything starts, with the file and the fix: a directory
without config.json, an architecture transformers does not know, safetensors of another shape, and the
built-in Llama asked to take Qwen2's biased projections. Nothing is written into the run directory."""

import json

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator import Orchestrator
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
