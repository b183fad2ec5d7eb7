"""archipelago's driver: config, fit(), CLI and reports.

    from orchestrator import Orchestrator, JobConfig
    result = Orchestrator(JobConfig.from_toml("examples/cpu-tiny.toml")).fit()
"""

from orchestrator.config import JobConfig
from orchestrator.errors import (ArchipelagoError, CheckpointError, ClusterError, ConfigError,
                                 DataError)

__all__ = ["ArchipelagoError", "CheckpointError", "ClusterError", "ConfigError", "DataError", "FitResult",
           "JobConfig", "Orchestrator", "RunReport"]


def __getattr__(name: str):
    # fit.py imports the worker loop, which imports orchestrator.config: importing it lazily keeps
    # workers (which only need config and errors) from pulling in the driver.
    if name in ("Orchestrator", "FitResult"):
        from orchestrator import fit
        return getattr(fit, name)
    if name == "RunReport":
        from orchestrator.report import RunReport
        return RunReport
    raise AttributeError(f"module 'orchestrator' has no attribute {name!r}")
