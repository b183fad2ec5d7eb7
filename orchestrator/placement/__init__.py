"""Placement: where every worker runs, how much work it gets, and what a step costs.

    from orchestrator.placement import Plan
    plan = Plan.load("plan.json"); plan.worker(rank).device_uuid; plan.batch_layout()
"""

from orchestrator.placement.plan import (AllReduce, DataParallel, DeviceKind, Objective, Plan, Prediction,
                                         WorkerPlacement)

__all__ = ["AllReduce", "DataParallel", "DeviceKind", "Objective", "Plan", "Prediction", "WorkerPlacement"]
