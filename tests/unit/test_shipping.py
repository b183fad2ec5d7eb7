"""orchestrator/shipping.py: the user's model code goes to the workers with the job (Ray's py_modules)
when the workers could not import it otherwise; installed code, the standard library, the driver's own
script and archipelago's own models stay behind."""

from __future__ import annotations

import importlib
import json
import sys
import types

import pytest
import torch

from core.config import JobConfig
from orchestrator.shipping import modules_to_ship
from workers.models import make_workload
from workers.models.hf import HFWorkload
from workers.models.workloads import ModuleWorkload

MODEL = {"kind": "custom", "seq_len": 16, "vocab_size": 32}
FACTORY = """import torch.nn as nn
def build(table):
    return nn.Sequential(nn.Embedding(table["vocab_size"], 8), nn.Linear(8, table["vocab_size"]))
"""
WORKLOAD = FACTORY + """
class Bigram:
    name = "bigram"
    def identity(self): return {"kind": "custom", "factory": "bigram"}
    def build(self): return build({"vocab_size": 32})
    def loss(self, model, inputs, targets, *, loss_kernel="plain", loss_mask=None, positions=None):
        return nn.functional.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    def blocks(self, model): return []
def workload(table):
    return Bigram()
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """Writes modules into a directory on the path, as a user's beside their job file; forgets them after."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(relative: str, text: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)

    yield write
    for name in [name for name in sys.modules if name.split(".")[0] in ("beside_the_job", "next_to_the_job", "my_models", "my_layers")]:
        del sys.modules[name]


def custom(factory: str):
    return make_workload(JobConfig.from_dict({"model": {**MODEL, "factory": factory}}).model)


def test_a_module_beside_the_job_is_shipped(user_code):
    user_code("beside_the_job.py", FACTORY)
    assert modules_to_ship(custom("beside_the_job:build")) == [importlib.import_module("beside_the_job")]


def test_a_module_the_factory_s_module_imports_from_beside_it_is_shipped_too(user_code):
    user_code("my_layers.py", "import torch.nn as nn\ndef head(width, vocab):\n    return nn.Linear(width, vocab)\n")
    user_code("next_to_the_job.py", FACTORY.replace("import torch.nn as nn", "import torch.nn as nn\nimport my_layers"))
    shipped = modules_to_ship(custom("next_to_the_job:build"))
    assert [m.__name__ for m in shipped] == ["next_to_the_job", "my_layers"]  # a worker elsewhere imports both


def test_a_package_of_the_user_s_is_shipped_whole_and_so_is_a_workload_s(user_code):
    user_code("my_models/__init__.py", "")
    user_code("my_models/lm/factories.py", WORKLOAD)
    package = importlib.import_module("my_models")
    assert modules_to_ship(custom("my_models.lm.factories:build")) == [package]
    workload = custom("my_models.lm.factories:workload")  # a workload of the user's: its class's package
    assert type(workload).__name__ == "Bigram" and modules_to_ship(workload) == [package]


def test_installed_code_the_standard_library_and_the_driver_s_script_stay_behind(tmp_path, monkeypatch):
    config = JobConfig.from_dict({"model": {**MODEL, "factory": "x:y"}}).model
    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train.py")  # the user's script, run as `python train.py`
    monkeypatch.setitem(sys.modules, "__main__", script)
    in_main = lambda table: None  # noqa: E731 - a factory defined in that script: it travels pickled
    in_main.__module__ = "__main__"
    for factory in (torch.nn.Linear, json.loads, in_main):  # site-packages, the standard library, __main__
        assert modules_to_ship(ModuleWorkload(config, factory)) == [], factory
    assert modules_to_ship(make_workload(JobConfig.from_dict({"model": {"kind": "llama", "n_layer": 1}}).model)) == []
    hf = HFWorkload(config=config, hf_config=None, name="hf", has_weights=False)  # in an editable install too
    assert modules_to_ship(hf) == []
