"""[model] kind = "custom": the user's factory is imported, checked and trained through the workload
interface, and every way a factory goes wrong is a one-line ConfigError before Ray starts."""

import pytest
import ray
import torch

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator.cli import main
from planning.model_size import model_facts
from tests.engine_support import engine_spec
from workers.engine import Engine
from workers.models import make_workload, register_factory
from workers.models.factory_checks import factory_table

CUSTOM = {"kind": "custom", "factory": "tests.custom_models:lstm", "seq_len": 16, "vocab_size": 257, "width": 24}


def config(**model) -> JobConfig:
    return JobConfig.from_dict({"model": {**CUSTOM, **model},
                                "train": {"global_batch_size": 8, "micro_batch_size": 4, "lr": 1e-2,
                                          "min_lr": 1e-2, "warmup_steps": 0}})


def test_a_factory_gets_the_model_table_and_its_own_keys():
    workload = make_workload(config().model)
    model = workload.build()
    assert model.embed.embedding_dim == 24 and model.out.out_features == 257  # width: the table's own key
    assert workload.identity()["width"] == 24 and workload.name == "tests.custom_models:lstm"
    facts = model_facts(workload, 16)
    assert facts.parameters == sum(p.numel() for p in model.parameters()) and facts.blocks == 0
    assert facts.counted and facts.flops_per_token > 6 * facts.parameters * 0.5  # the LSTM's matmuls, counted


def test_the_built_in_models_sizing_rules_do_not_bind_a_factory_s_table():
    table = factory_table(config(n_embd=90, n_head=4).model)  # 90 / 4 heads: a GPT's refusal, a GRU's width
    assert (table["n_embd"], table["n_head"]) == (90, 4)


def test_the_engine_trains_a_model_that_is_not_a_transformer():
    engine = Engine(engine_spec(config(), 1, 4, 2), 0, torch.device("cpu"))
    torch.manual_seed(0)
    batches = [torch.randint(0, 257, (4, 17)) for _ in range(2)]
    losses = [float(engine(batches, 1e-2)[0]) for _ in range(15)]
    assert losses[-1] < losses[0] - 1.0


def test_the_python_api_takes_the_factory_itself():
    from tests.custom_models import lstm

    reference = register_factory(lstm)
    workload = make_workload(JobConfig.from_dict({"model": {**CUSTOM, "factory": reference}}).model)
    assert workload.factory is lstm and reference == "tests.custom_models:lstm"


@pytest.mark.parametrize("factory, said", [
    ("tests.custom_models", "is not package.module:function"),
    ("tests.no_such_module:lstm", "cannot import 'tests.no_such_module': ModuleNotFoundError"),
    ("tests.custom_models:transformer", "has no 'transformer'"),
    ("tests.custom_models:raises", "raised KeyError: 'hidden_size'"),
    ("tests.custom_models:not_a_module", "returned a dict, not an nn.Module"),
    ("tests.custom_models:wrong_vocabulary", "returns (2, 8, 256) for token ids of shape (2, 8), not logits of shape (2, 8, 257)"),
    ("tests.custom_models:unseeded", "builds different weights from the same torch seed (out.bias)"),
    ("tests.custom_models:frozen", "has nothing to train: none of its 7 parameters requires a gradient"),
    ("tests.custom_models:integer_logits", "returns torch.int64 logits"),
    ("tests.custom_models:detached_logits", "do not depend on its trainable parameters"),
    ("tests.custom_models:in_bf16", "is not in fp32 (embed.weight is torch.bfloat16) — build it in fp32, without .to"),
    ("tests.custom_models:moved_to_a_device", "moves the model it builds to a device (on the meta device torch "
                                              "cannot copy it) — build the model on torch's current device"),
    ("tests.custom_models:with_an_unused_layer", "trainable parameters its forward does not use (spare.weight, "
                                                 "spare.bias): no gradient reaches them — freeze them"),
    ("tests.custom_workloads:per_token_loss", "its loss is a [16] torch.float32 tensor, not a scalar to differentiate"),
    ("tests.custom_workloads:builds_nothing", "its build() made a NoneType, not an nn.Module"),
    ("tests.custom_workloads:blocks_of_another_model", "block 0 of its blocks(model) is not a module of the model"),
])
def test_a_bad_factory_is_one_line_from_plan_and_fit_before_ray_starts(factory, said, tmp_path, capsys, monkeypatch):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nkind = "custom"\nfactory = "{factory}"\nseq_len = 16\n[data]\npath = "{tmp_path}/none"\n')
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("Ray started before the refusal"))
    monkeypatch.setattr("orchestrator.cli.discover_cluster", lambda *a, **k: pytest.fail("the live cluster was mapped first"))
    outputs = []
    for argv in (["plan", "--generate", "8xH100-SXM:1", "--config", str(path)], ["plan", "--config", str(path)],
                 ["fit", str(path)]):
        assert main(argv) == 2
        outputs.append(capsys.readouterr().out)
    for out in outputs:
        assert "[model] factory" in out and said in out and out.count("\n") == 1 and "Traceback" not in out


def test_a_custom_model_cannot_run_the_next_forward_overlap():
    with pytest.raises(ConfigError, match=r"\[parallel\] overlap.*only the built-in gpt and llama"):
        JobConfig.from_dict({"model": CUSTOM, "train": {"grad_clip": 0.0}, "parallel": {"overlap": "next_forward"}})


def test_a_plan_says_when_the_model_s_flops_were_estimated_not_counted(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(f'[model]\nkind = "custom"\nfactory = "tests.custom_workloads:cpu_weighted"\nseq_len = 16\n'
                    f'vocab_size = 257\n[data]\npath = "{tmp_path}/none"\n')
    facts = model_facts(make_workload(JobConfig.from_toml(path).model), 16)
    assert not facts.counted and facts.flops_per_token == 6 * facts.parameters
    assert main(["plan", "--generate", "8xH100-SXM:1", "--config", str(path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"note: FLOPs per token estimated as 6 × {facts.parameters:,} parameters, not counted" in out
