"""archipelago's driver: plan the job, run its workers under Ray Train, account for the run.

    from orchestrator import Orchestrator, JobConfig
    result = Orchestrator(JobConfig.from_toml("examples/cpu-tiny.toml")).fit()
"""

from core.config import JobConfig
from core.errors import ArchipelagoError, CheckpointError, ClusterError, ConfigError, DataError
from orchestrator.accounting.report import RunReport
from orchestrator.fit import FitResult, Orchestrator

__all__ = ["ArchipelagoError", "CheckpointError", "ClusterError", "ConfigError", "DataError", "FitResult",
           "JobConfig", "Orchestrator", "RunReport"]
