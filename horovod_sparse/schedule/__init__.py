"""Shared pieces for planning when gradients are exchanged: cost models, bucket plans and
an event-driven simulator of one step's communications.

Used by :mod:`horovod_sparse.whatif` (the "should I compress?" advisor) and meant for
the scheduling work (MG-WFBP / ASC-WFBP), which needs the same three things: what one
exchange of M bytes costs (:mod:`.cost`), which gradients go together (:mod:`.plans`),
and when each exchange starts and ends given when its gradients are ready
(:mod:`.simulate`).

    >>> from horovod_sparse.schedule import CostModel, simulate
    >>> simulate(ready=[0.0, 0.0], sizes=[100, 300], plan=[(0, 1), (1, 2)],
    ...          cost=CostModel(a=1.0, b=0.01)).step_end          # 2a + b(M1 + M2)
    6.0
"""
from horovod_sparse.schedule.cost import CostModel, RingAllreduce, TableCost
from horovod_sparse.schedule.plans import layer_plan, netai_plan, single_plan, threshold_plan
from horovod_sparse.schedule.simulate import Schedule, ready_times, simulate, simulate_cycles

__all__ = ["CostModel", "RingAllreduce", "TableCost", "Schedule", "ready_times", "simulate",
           "simulate_cycles", "layer_plan", "netai_plan", "single_plan", "threshold_plan"]
