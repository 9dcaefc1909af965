"""``schedule="auto"`` settled by measurement: the simulator's candidate plans run in turn,
a few steps each, and the one measured fastest is kept (:class:`~horovod_sparse.schedule.trials.PlanTrials`).
The model proposes, the run decides, as Horovod's own autotuner (``HOROVOD_AUTOTUNE``) does
with its fusion knobs: on a machine where the exchanges compete with backward or with
Horovod's thread for cores, the fitted costs (measured with nothing else running) can rank
the plans wrongly (docs/results/scheduling.md section 8); the end of the exchanges alone ranked plans
wrongly here, so a step's time is its whole period.

Candidates: the distinct plans of the planned schedules, the simulator's pick first, then in
order of predicted step end (:func:`candidates`).
"""
from horovod_sparse.schedule.trials import WARMUP_STEPS, PlanTrials  # noqa: F401 (their home for the schedules)
from horovod_sparse.step.channels import BucketPlan


def candidates(choice, order):
    """``[(schedule, BucketPlan)]``: the distinct plans of ``choice``
    (:class:`~horovod_sparse.schedule.planner.Choice`) over the gradient keys ``order``
    (backward order), fastest predicted first; a plan that equals an earlier one is tried
    once, under the earlier one's name."""
    out = {}
    for name in sorted(choice.predicted, key=lambda n: (choice.predicted[n], n != choice.schedule)):
        out.setdefault(BucketPlan.from_ranges(choice.plans[name], order), name)
    return [(name, plan) for plan, name in out.items()]
