"""Planning when gradients are exchanged: cost models, bucket plans and planners, and an
event-driven simulator of one step's communications.

Used by :mod:`horovod_sparse.whatif` (the "should I compress?" advisor) and by the
scheduling work (WFBP, MG-WFBP, the exact optimum, ASC-WFBP): what one exchange of M bytes
costs and how two at once slow each other (:mod:`.cost`), which gradients go together
(:mod:`.plans`: static plans, MG-WFBP's greedy merge, the exact DP; :mod:`.asc`: buckets
on two channels; :mod:`.planner`: a schedule's name to its plan), when each exchange
starts and ends given when its gradients are ready (:mod:`.simulate`), and a plan as
Horovod's own ``groups=`` (:mod:`.groups`). Usable on its own, without MPI.

    >>> from horovod_sparse.schedule import CostModel, simulate
    >>> simulate(ready=[0.0, 0.0], sizes=[100, 300], plan=[(0, 1), (1, 2)],
    ...          cost=CostModel(a=1.0, b=0.01)).step_end          # 2a + b(M1 + M2)
    6.0
    >>> plan = make_plan("mgwfbp", compute_times=[0.0, 0.5, 1.0], sizes=[3, 1, 1],
    ...                  cost=CostModel(a=0.1, b=1.0))
    >>> plan, round(simulate(ready_times([0.0, 0.5, 1.0]), [3, 1, 1], plan, CostModel(0.1, 1.0)).step_end, 9)
    ([(0, 1), (1, 3)], 5.2)
"""
from horovod_sparse.schedule.asc import asc_plan
from horovod_sparse.schedule.cost import CostModel, RingAllreduce, TableCost, fit_simultaneity
from horovod_sparse.schedule.groups import horovod_groups, plan_from_groups
from horovod_sparse.schedule.planner import PLANNED, SCHEDULES, choose_plan, make_plan
from horovod_sparse.schedule.plans import (layer_plan, mgwfbp_plan, netai_plan, optimal_plan, single_plan,
                                           threshold_plan, wfbp_plan)
from horovod_sparse.schedule.simulate import Schedule, ready_times, simulate, simulate_cycles

__all__ = ["CostModel", "RingAllreduce", "TableCost", "fit_simultaneity", "Schedule", "ready_times", "simulate",
           "simulate_cycles", "layer_plan", "wfbp_plan", "netai_plan", "single_plan", "threshold_plan",
           "mgwfbp_plan", "optimal_plan", "asc_plan", "PLANNED", "SCHEDULES", "make_plan", "choose_plan", "horovod_groups",
           "plan_from_groups"]
