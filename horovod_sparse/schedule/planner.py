"""One entry point for a schedule's name: the plan it runs, as the runtime and the
benchmarks ask for it (``schedule="mgwfbp"``).

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> line = CostModel(a=2.0, b=0.0)
    >>> [make_plan(name, [1, 1, 1], [1, 1, 1], line) for name in ("after_backward", "wfbp", "optimal")]
    [[(0, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 3)]]
"""
from horovod_sparse.schedule.asc import UNMEASURED_SIMULTANEITY, asc_plan
from horovod_sparse.schedule.plans import backward_trace, mgwfbp_plan, optimal_plan, single_plan, wfbp_plan

#: The planned schedules, in the order of the docs.
PLANNED = ("after_backward", "wfbp", "mgwfbp", "optimal", "asc")


def make_plan(schedule, compute_times, sizes, cost, channels=2, simultaneity=UNMEASURED_SIMULTANEITY):
    """The plan of ``schedule`` (one of :data:`PLANNED`) for a backward trace
    (``compute_times`` seconds before each gradient and ``sizes`` bytes, in backward order)
    and a ``cost`` model. ``channels`` and ``simultaneity`` serve ``"asc"`` only; the other
    plans run on one channel."""
    if schedule not in PLANNED:
        raise ValueError(f"schedule must be one of {list(PLANNED)}, got {schedule!r}")
    backward_trace(compute_times, sizes)
    if schedule == "after_backward":
        return single_plan(len(sizes))
    if schedule == "wfbp":
        return wfbp_plan(len(sizes))
    if schedule == "mgwfbp":
        return mgwfbp_plan(compute_times, sizes, cost)
    if schedule == "optimal":
        return optimal_plan(compute_times, sizes, cost)
    return asc_plan(compute_times, sizes, cost, channels=channels, simultaneity=simultaneity)
