"""README's "Your own model" runs as written: its module and job file, trained through the engine."""

import importlib
import re
import sys
from pathlib import Path

import torch

from core.config import JobConfig
from tests.engine_support import engine_spec
from workers.engine import Engine
from workers.models import make_workload

README = Path(__file__).resolve().parents[2] / "README.md"


def blocks_of_section(title: str) -> dict[str, str]:
    section = README.read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return {language: code for language, code in re.findall(r"```(\w+)\n(.*?)```", section, flags=re.S)}


def test_the_readme_factory_and_job_train(tmp_path, monkeypatch, request):
    blocks = blocks_of_section("Your own model")
    (tmp_path / "my_models.py").write_text(blocks["python"])
    (tmp_path / "gru.toml").write_text(blocks["toml"])
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_models", None)
    # Forgotten afterwards: test_shipping writes a package of the same name.
    request.addfinalizer(lambda: sys.modules.pop("my_models", None))
    config = JobConfig.from_toml(tmp_path / "gru.toml")
    workload = make_workload(config.model)
    assert workload.name == "my_models:build" and workload.build().embed.embedding_dim == 256
    engine = Engine(engine_spec(config, 1, 4, 1), 0, torch.device("cpu"))
    torch.manual_seed(0)
    batch = [torch.randint(0, 257, (4, config.model.seq_len + 1))]
    first = float(engine(batch, 3e-3)[0])
    last = [float(engine(batch, 3e-3)[0]) for _ in range(5)][-1]
    assert last < first
    assert importlib.import_module("my_models").build is not None
