"""What `Orchestrator(...)` is given, refused before anything runs in the caller's own terms: Python keywords
from Python (the command line's parser names its flags itself)."""

from __future__ import annotations

import pytest

from core.config import JobConfig
from core.errors import ConfigError
from orchestrator import Orchestrator


def test_resume_with_overwrite_is_refused_in_the_keywords_the_caller_used(tmp_path):
    config = JobConfig.from_dict({"runs_dir": str(tmp_path / "runs")})
    with pytest.raises(ConfigError, match=r"^Orchestrator\(\.\.\.\): resume=True and overwrite=True contradict") as e:
        Orchestrator(config, resume=True, overwrite=True)
    assert "--" not in str(e.value)
    assert not (tmp_path / "runs").exists()
