"""The models archipelago trains, reached through workloads (core/workload.py): make_workload(config.model)."""

from workers.models.workloads import check_takes_loss_masks, make_workload, register_factory

__all__ = ["check_takes_loss_masks", "make_workload", "register_factory"]
