"""The [placement] section of a job config: defaults, prices, and refusals that name the key."""

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from tests.hf_support import write_model


def test_defaults_plan_for_speed_on_every_device():
    placement = JobConfig.from_dict({}).placement
    assert placement.objective == "fastest" and placement.min_gpus == 1 and placement.max_gpus == 0
    assert placement.tensor_parallel_size == 1 and placement.use_mig and placement.pricing == "on_demand"


def test_prices_are_a_table_of_numbers(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('[placement]\nobjective = "cheapest"\npricing = "spot"\n'
                    '[placement.prices]\n"H100-SXM5-80GB" = 1.9\ncpu = 0\n')
    placement = JobConfig.from_toml(path).placement
    assert placement.prices == {"H100-SXM5-80GB": 1.9, "cpu": 0.0} and placement.pricing == "spot"


@pytest.mark.parametrize("placement, where, message", [
    ({"objective": "cheapest_under_deadline"}, "[placement] deadline_hours", "needs a deadline"),
    ({"min_gpus": 8, "max_gpus": 4}, "[placement] max_gpus", "is below min_gpus = 8"),
    ({"tensor_parallel_size": -1}, "[placement] tensor_parallel_size", "must be 0 (the planner picks) or more"),
    ({"prices": {"L4": -1.0}}, "[placement] prices.L4", "must be 0 or more"),
    ({"prices": {"L4": "cheap"}}, "[placement] prices.L4", "must be a number"),
    ({"prices": 3}, "[placement] prices", "must be a table"),
    ({"objective": "quickest"}, "[placement] objective", "is not one of"),
    ({"max_gpu": 4}, "[placement] max_gpu", "unknown key"),
])
def test_bad_placement_names_the_key(placement, where, message):
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"placement": placement})
    assert refused.value.where == where and message in refused.value.what


@pytest.mark.parametrize("sections, where, message", [
    ({"model": {"kind": "hf", "hf_dir": "HF_DIR"}}, "[placement] tensor_parallel_size",
     "only the built-in gpt and llama models have"),
    ({"train": {"qat": "int8-weight"}}, "[train] qat", "no plan for the fake-quantized layers"),
])
def test_tensor_parallelism_is_refused_for_layers_it_has_no_plan_for(tmp_path, sections, where, message):
    """A transformers model and torchao's fake-quantized layers have no tensor-parallel plan: refused
    here rather than failing inside parallelize_module on the workers."""
    if "model" in sections:  # a transformers config.json to read
        write_model(tmp_path, "llama", weights=False)
        sections = {"model": {**sections["model"], "hf_dir": str(tmp_path)}}
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"cluster": {"use_gpu": True}, **sections, "placement": {"tensor_parallel_size": 2}})
    assert refused.value.where == where and message in refused.value.what


def test_tensor_parallelism_on_cpus_is_refused_not_dropped():
    """CPU plans split the batch only: a tensor_parallel_size there would have been silently ignored."""
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"placement": {"tensor_parallel_size": 2}})
    assert refused.value.where == "[placement] tensor_parallel_size" and "trains on CPUs" in refused.value.what
    assert "tensor_parallel_size = 1" in refused.value.fix
    for size in (0, 1):  # the planner's pick, and nothing split
        assert JobConfig.from_dict({"placement": {"tensor_parallel_size": size}}).placement.tensor_parallel_size == size


def test_an_elastic_job_with_a_fixed_tensor_parallel_size_is_refused_and_the_planners_pick_is_not():
    """Ray Train may grant an elastic group a worker count the groups do not divide (3 for groups of 2)."""
    gpu_job = {"cluster": {"use_gpu": True, "num_workers": 4}, "elastic": {"min_workers": 2}}
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({**gpu_job, "placement": {"tensor_parallel_size": 2}})
    assert refused.value.where == "[elastic] min_workers"
    assert "runs only on multiples of 2" in refused.value.what and "tensor_parallel_size = 0" in refused.value.fix
    assert JobConfig.from_dict({**gpu_job, "placement": {"tensor_parallel_size": 0}}).placement.tensor_parallel_size == 0


def test_a_model_that_does_not_split_over_the_tensor_parallel_size_names_the_sizes_that_do():
    llama = {"kind": "llama", "n_layer": 2, "n_head": 8, "n_kv_head": 2, "n_embd": 64, "seq_len": 32}
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"cluster": {"use_gpu": True}, "model": llama, "placement": {"tensor_parallel_size": 4}})
    assert refused.value.where == "[placement] tensor_parallel_size"
    assert refused.value.what == "[model] n_kv_head = 2 does not split evenly over 4 ranks"
    assert refused.value.fix == "set tensor_parallel_size to 1 or 2"
    # Sizes every split key takes: 12 heads (1, 2, 3, 4, 6, 12) over 1,000 positions (1, 2, 4, 5, 8, 10, …).
    gpt = {"n_layer": 1, "n_head": 12, "n_embd": 96, "seq_len": 1000}
    with pytest.raises(ConfigError) as refused:
        JobConfig.from_dict({"cluster": {"use_gpu": True}, "model": gpt, "placement": {"tensor_parallel_size": 8}})
    assert refused.value.fix == "set tensor_parallel_size to 1, 2 or 4"
