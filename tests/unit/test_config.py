from pathlib import Path

import pytest

from core.config import JobConfig
from core.errors import ConfigError

EXAMPLES = Path(__file__).parents[2] / "examples"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def error_for(tmp_path: Path, text: str) -> str:
    with pytest.raises(ConfigError) as info:
        JobConfig.from_toml(write(tmp_path, text))
    return str(info.value)


def test_defaults_are_a_valid_job():
    config = JobConfig()
    assert config.grad_accum_steps == 1
    assert config.tokens_per_step == 32 * 128


def test_example_config_loads():
    config = JobConfig.from_toml(EXAMPLES / "cpu-tiny.toml")
    assert config.name == "cpu-tiny"
    assert config.cluster.num_workers == 2
    assert config.train.steps == 300
    assert config.checkpoint.keep_last == 2


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError) as info:
        JobConfig.from_toml(tmp_path / "nope.toml")
    assert "nope.toml: config file not found" in str(info.value)
    assert "examples/cpu-tiny.toml" in str(info.value)


@pytest.mark.parametrize("text", ["", "# only a comment\n\n"])
def test_a_config_that_sets_nothing_is_refused(tmp_path, text):
    message = error_for(tmp_path, text)
    assert "job.toml: the config sets nothing" in message
    assert "examples/cpu-tiny.toml" in message


def test_malformed_toml_names_the_line(tmp_path):
    message = error_for(tmp_path, "[train]\nsteps = = 3\n")
    assert "job.toml" in message and "malformed TOML" in message and "line 2" in message


def test_unknown_key_suggests_the_close_one(tmp_path):
    message = error_for(tmp_path, "[train]\nmicro_batchsize = 4\n")
    assert "job.toml: [train] micro_batchsize: unknown key" in message
    assert "did you mean 'micro_batch_size'?" in message


def test_renamed_key_says_what_to_write_instead(tmp_path):
    message = error_for(tmp_path, "[train]\nchunked_loss = true\n")
    assert "[train] chunked_loss: unknown key" in message and 'loss_kernel = "chunked"' in message


def test_unknown_section(tmp_path):
    message = error_for(tmp_path, "[trian]\nsteps = 3\n")
    assert "trian: unknown key" in message and "'train'" in message


def test_wrong_type(tmp_path):
    message = error_for(tmp_path, '[train]\nsteps = "many"\n')
    assert "[train] steps: must be an integer, got 'many' (str)" in message


def test_bool_is_not_an_integer(tmp_path):
    assert "must be an integer" in error_for(tmp_path, "[train]\nsteps = true\n")


def test_integer_is_accepted_for_a_float(tmp_path):
    assert JobConfig.from_toml(write(tmp_path, "[train]\nlr = 1\nmin_lr = 0\n")).train.lr == 1.0


def test_negative_batch_size(tmp_path):
    message = error_for(tmp_path, "[train]\nmicro_batch_size = -4\n")
    assert "job.toml: [train] micro_batch_size: must be positive, got -4" in message
    assert "set micro_batch_size to a number above 0" in message


def test_negative_topk_ramp_names_the_key_and_the_fix(tmp_path):
    message = error_for(tmp_path, "[parallel]\ncomm_hook = \"topk\"\ntopk_ramp_steps = -5\n")
    assert "[parallel] topk_ramp_steps" in message and "-5" in message and "topk_ramp_steps = 0" in message


def test_bad_compile_check_tolerances_name_the_key_and_the_fix(tmp_path):
    message = error_for(tmp_path, "[compile]\ncheck_tolerance = -0.1\n")
    assert "[compile] check_tolerance: must be 0 or more, got -0.1" in message and "check_tolerance = 0" in message
    message = error_for(tmp_path, "[compile]\ngradient_tolerance = 0\n")
    assert "[compile] gradient_tolerance: must be more than 0, got 0" in message and "check_tolerance = 0" in message


def test_choice_outside_the_allowed_set(tmp_path):
    message = error_for(tmp_path, '[train]\nprecision = "fp64"\n')
    assert "[train] precision: 'fp64' is not one of 'auto', 'fp32', 'bf16'" in message


def test_heads_must_divide_width(tmp_path):
    message = error_for(tmp_path, "[model]\nn_embd = 100\nn_head = 3\n")
    assert "[model] n_head" in message and "not divisible" in message


def test_global_batch_must_split_evenly(tmp_path):
    message = error_for(tmp_path, "[train]\nglobal_batch_size = 30\nmicro_batch_size = 4\n[cluster]\nnum_workers = 2\n")
    assert "[train] global_batch_size: 30 is not a multiple of micro_batch_size × num_workers = 4 × 2 = 8" in message
    assert "e.g. 32" in message


def test_section_must_be_a_table(tmp_path):
    assert "must be a table" in error_for(tmp_path, "train = 3\n")


def test_grad_accum_from_batch_sizes():
    config = JobConfig.from_dict({"train": {"global_batch_size": 64, "micro_batch_size": 8}, "cluster": {"num_workers": 2}})
    assert config.grad_accum_steps == 4


def test_round_trips_through_a_dict():
    config = JobConfig.from_toml(EXAMPLES / "cpu-tiny.toml")
    assert JobConfig.from_dict(config.to_dict()) == config


def test_powersgd_over_gloo_is_refused_before_it_hangs(tmp_path):
    message = error_for(tmp_path, '[parallel]\ncomm_hook = "powersgd"\n')  # CPU workers: gloo
    assert "[parallel] comm_hook" in message and "hangs over gloo" in message and 'comm_hook = "bf16"' in message
    message = error_for(tmp_path, '[cluster]\nuse_gpu = true\n[parallel]\ncomm_hook = "powersgd"\nbackend = "gloo"\n')
    assert "hangs over gloo" in message


def test_compiled_ddp_refuses_buckets_below_a_mebibyte():
    small = {"parallel": {"bucket_mb": 0.25}, "cluster": {"num_workers": 2}}
    with pytest.raises(ConfigError) as caught:
        JobConfig.from_dict({**small, "compile": {"enable": True}})
    assert caught.value.where == "[parallel] bucket_mb" and "1 MiB" in str(caught.value)
    JobConfig.from_dict(small)  # eager DDP takes any size
    JobConfig.from_dict({**small, "compile": {"enable": True}, "train": {"grad_clip": 0.0},
                         "parallel": {"bucket_mb": 0.25, "overlap": "next_forward"}})  # compiled block by block


@pytest.mark.parametrize("example", sorted(p.name for p in EXAMPLES.glob("*.toml")))
def test_every_example_config_loads(example):
    config = JobConfig.from_toml(EXAMPLES / example)
    assert config.name == Path(example).stem
