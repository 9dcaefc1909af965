"""One entry point for a schedule's name: the plan it runs, as the runtime and the
benchmarks ask for it (``schedule="mgwfbp"``).

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> line = CostModel(a=2.0, b=0.0)
    >>> [make_plan(name, [1, 1, 1], [1, 1, 1], line) for name in ("after_backward", "wfbp", "optimal")]
    [[(0, 3)], [(0, 1), (1, 2), (2, 3)], [(0, 3)]]
    >>> choice = choose_plan("auto", [1, 1, 1], [1, 1, 1], line)
    >>> choice.schedule, choice.plan, choice.predicted["wfbp"]   # 3 start-ups of 2 s after the first gradient
    ('after_backward', [(0, 3)], 7.0)
"""
from horovod_sparse.schedule.asc import UNMEASURED_SIMULTANEITY, asc_plan
from horovod_sparse.schedule.plans import backward_trace, mgwfbp_plan, optimal_plan, single_plan, wfbp_plan
from horovod_sparse.schedule.simulate import ready_times, simulate

#: The planned schedules, in the order of the docs.
PLANNED = ("after_backward", "wfbp", "mgwfbp", "optimal", "asc")
#: What a compressor's ``schedule=`` accepts: a planned schedule, or "auto" (the one the
#: simulator predicts fastest, from measured arrivals and costs).
SCHEDULES = PLANNED + ("auto",)


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


def channels_of(schedule):
    """Channels a schedule runs on: two for ``"asc"`` (and ``"auto"``, which may pick it), else one."""
    return 2 if schedule in ("asc", "auto") else 1


class Choice:
    """A planned schedule: ``schedule`` (its name), ``plan`` (its ranges), ``predicted``
    ({schedule: simulated step end in seconds after backward starts}) and ``plans``
    ({schedule: its ranges}, every schedule simulated: ``"auto"`` tries them in turn)."""

    def __init__(self, schedule, plan, predicted, plans=None):
        self.schedule, self.plan, self.predicted = schedule, plan, predicted
        self.plans = {schedule: plan} if plans is None else plans

    def __repr__(self):
        return f"Choice({self.schedule!r}, {self.plan!r})"


def choose_plan(schedule, compute_times, sizes, cost, simultaneity=UNMEASURED_SIMULTANEITY, tail_s=0.0):
    """Plan ``schedule`` (one of :data:`SCHEDULES`) and simulate it; ``"auto"`` plans every
    schedule of :data:`PLANNED` and keeps the earliest simulated step end (ties go to the
    earlier in :data:`PLANNED`, the simpler). ``tail_s``: backward's time after its last
    gradient (until the optimizer's step)."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {schedule!r}")
    ready = ready_times(compute_times)
    backward_end = (ready[-1] if ready else 0.0) + tail_s
    plans, predicted = {}, {}
    for name in (PLANNED if schedule == "auto" else (schedule,)):
        channels = channels_of(name)
        plans[name] = make_plan(name, compute_times, sizes, cost, channels=channels, simultaneity=simultaneity)
        predicted[name] = simulate(ready, sizes, plans[name], cost, channels=channels,
                                   backward_end=backward_end, simultaneity=simultaneity).step_end
    best = min(predicted, key=predicted.get)
    return Choice(best, plans[best], predicted, plans)
