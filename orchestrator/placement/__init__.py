"""Placement: where every worker runs, how much work it gets, and what a step costs.

    from orchestrator import placement
    plan = placement.make_plan(topology, config)     # a Plan (see plan.py), or PlacementError
    plan.worker(rank).device_uuid; plan.batch_layout(); plan.save("plan.json")
"""

from orchestrator.placement.plan import (AllReduce, DataParallel, DeviceKind, Objective, Plan, Prediction,
                                         WorkerPlacement)

__all__ = ["AllReduce", "DataParallel", "DeviceKind", "Objective", "Plan", "Prediction", "WorkerPlacement",
           "make_plan"]


# Not named `plan`: that is the submodule's name, and importing the submodule anywhere rebinds the
# package attribute to it.
def make_plan(topology, config, **kwargs) -> Plan:
    """Plans `config` on `topology` (see planner.Planner for the keyword arguments)."""
    from orchestrator.placement.planner import Planner  # the planner imports cost, which imports plan
    return Planner(topology, config, **kwargs).plan()
