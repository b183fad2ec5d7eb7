"""Planning: where every worker runs, how much work it gets, and what a step costs.

    import planning
    plan = planning.make_plan(topology, config)     # a core.plan.Plan, or PlacementError

Below the driver and above the workers: it imports no Ray, so benchmarks and GPU machines without Ray
use the planner, the memory estimate and the model facts as the driver does.

The planner (planner.py) searches over the device pool (devices.py) with one cost model
(costing.py: compute.py, collectives.py, hook_costs.py, memory.py, prices.py) and builds the Plan.
Each device's figures come from [devices] tables, the probe's measurements or the catalog
(figures.py); a calibration file fitted to finished runs adjusts the cost model (calibration.py).
"""

from planning.planner import make_plan

__all__ = ["make_plan"]
