"""``schedule="auto"`` settled by measurement: the simulator's candidate plans run in turn,
a few steps each, and the one measured fastest is kept. The model proposes, the run
decides, as Horovod's own autotuner (``HOROVOD_AUTOTUNE``) does with its fusion knobs: on a
machine where the exchanges compete with backward or with Horovod's thread for cores, the
fitted costs (measured with nothing else running) can rank the plans wrongly
(docs/scheduling.md section 8).

1. Candidates: the distinct plans of the planned schedules, the simulator's pick first,
   then in order of predicted step end (:func:`candidates`).
2. Each runs one warm-up step (new buckets make their pipelines, and a sparsifier's first
   step computes its threshold exactly), then ``steps`` timed steps. A step's time is the
   part of it a plan changes: from the step's first ``compress`` to the end of its
   exchanges (its first ``decompress``), on this rank.
3. After the last candidate's last step, one ``Allreduce(MAX)`` of every rank's times:
   every rank has the same numbers (a step is as slow as its slowest rank), takes the median
   per candidate and keeps the smallest (ties to the earlier). No broadcast: the choice is
   the same on every rank because its inputs are.

    trials = PlanTrials([("mgwfbp", plan_a), ("wfbp", plan_b)], steps=3)
    trials.record(0.120)              # a step of plan_a; True once its 1 + 3 steps are in
    ...
    best, medians = trials.decide(comm)   # collective, after trials.finished
"""
import statistics

from horovod_sparse.bench.step import max_over_ranks

#: steps each candidate runs before its timed steps
WARMUP_STEPS = 1


def candidates(choice, order):
    """``[(schedule, ranges)]``: the distinct plans of ``choice``
    (:class:`~horovod_sparse.schedule.planner.Choice`), fastest predicted first; a plan
    that equals an earlier one is tried once, under the earlier one's name."""
    seen, out = set(), []
    for name in sorted(choice.predicted, key=lambda n: (choice.predicted[n], n != choice.schedule)):
        ranges = tuple(tuple(b) + ((0,) if len(b) == 2 else ()) for b in choice.plans[name])
        if ranges not in seen:
            seen.add(ranges)
            out.append((name, choice.plans[name]))
    return out


class PlanTrials:
    """The candidate plans of one ``"auto"`` compressor and this rank's step times on them.

    candidates: ``[(schedule name, plan)]`` in the order they run; steps: timed steps per
    candidate (each runs :data:`WARMUP_STEPS` more first).
    """

    def __init__(self, candidates, steps):
        if not candidates:
            raise ValueError("auto needs at least one candidate plan")
        self.candidates = list(candidates)
        self.steps = steps
        self.times = []  # seconds per step, candidate after candidate, warm-up steps included

    @property
    def per_candidate(self):
        return WARMUP_STEPS + self.steps

    @property
    def index(self):
        """The candidate now running."""
        return min(len(self.times) // self.per_candidate, len(self.candidates) - 1)

    @property
    def finished(self):
        return len(self.times) >= self.per_candidate * len(self.candidates)

    def record(self, seconds):
        """One step of the current candidate took ``seconds``; True when its steps are all in."""
        self.times.append(float(seconds))
        return len(self.times) % self.per_candidate == 0

    def decide(self, comm):
        """Collective: ``(index of the fastest candidate, [median seconds of its timed steps
        per candidate])``, the same on every rank of ``comm``."""
        slowest = max_over_ranks(comm, self.times).tolist()
        medians = [statistics.median(slowest[i * self.per_candidate + WARMUP_STEPS:(i + 1) * self.per_candidate])
                   for i in range(len(self.candidates))]
        return min(range(len(medians)), key=medians.__getitem__), medians
