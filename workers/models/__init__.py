"""The models archipelago trains, reached through workloads (core/workload.py): make_workload(config.model)."""

from workers.models.workloads import make_workload, register_factory

__all__ = ["make_workload", "register_factory"]
