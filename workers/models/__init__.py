"""The models archipelago trains, reached through workloads (core/workload.py): make_workload(config.model)."""

from workers.models.workloads import adopt_workload, check_takes_loss_masks, make_workload, register_factory

__all__ = ["adopt_workload", "check_takes_loss_masks", "make_workload", "register_factory"]
