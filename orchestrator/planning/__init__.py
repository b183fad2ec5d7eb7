"""Planning: where every worker runs, how much work it gets, and what a step costs.

    from orchestrator import planning
    plan = planning.make_plan(topology, config)     # a core.plan.Plan, or PlacementError

The planner (planner.py) searches over the device pool (devices.py) with one cost model
(costing.py: compute.py, collectives.py, hook_costs.py, memory.py, prices.py) and builds the Plan.
"""

from orchestrator.planning.planner import make_plan

__all__ = ["make_plan"]
