"""What `Orchestrator(...)` is given, refused before anything runs in the caller's own terms: Python keywords
from Python (the command line's parser names its flags itself)."""

from __future__ import annotations

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator import Orchestrator
from tests.conftest import write_job


def test_resume_with_overwrite_is_refused_in_the_keywords_the_caller_used(tmp_path):
    config = JobConfig.from_dict({"runs_dir": str(tmp_path / "runs")})
    with pytest.raises(ConfigError, match=r"^Orchestrator\(\.\.\.\): resume=True and overwrite=True contradict") as e:
        Orchestrator(config, resume=True, overwrite=True)
    assert "--" not in str(e.value)
    assert not (tmp_path / "runs").exists()


def test_a_job_file_path_or_dict_is_read_as_the_command_line_reads_it(tmp_path):
    config = JobConfig.from_dict({"name": "given", "runs_dir": str(tmp_path / "runs")})
    path = write_job(tmp_path / "job.toml", config)
    for given in (path, str(path), config.to_dict()):
        assert Orchestrator(given).config == config


def test_anything_else_is_refused_naming_its_type_and_what_to_pass():
    with pytest.raises(ConfigError, match=r"Orchestrator\(config\): config is a list, not a job — pass a JobConfig"):
        Orchestrator(["job.toml"])
