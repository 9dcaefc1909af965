"""Plans settled by measurement: each candidate runs a few steps, and the one measured
fastest is kept, the same on every rank. ``schedule="auto"`` (:mod:`horovod_sparse.step.trials`)
and ``Compression.auto`` (:mod:`horovod_sparse.auto.runtime`) both decide this way.

1. Each candidate runs one warm-up step (new buckets make their pipelines, and a sparsifier's
   first step computes its threshold exactly), then ``steps`` timed steps. A step's time is its
   whole period on this rank, from its first ``compress`` to the next step's: forward,
   backward, the exchanges, Horovod's own synchronize and the optimizer, all of which a
   plan can slow down. So a step is timed when the next one starts (:meth:`PlanTrials.record`),
   and the last candidate runs one step more, untimed, while its last period comes in.
2. Then one ``Allreduce(MAX)`` of every rank's times: every rank has the same numbers (a
   step is as slow as its slowest rank), takes the median per candidate and keeps the
   smallest (ties to the earlier). No broadcast: the choice is the same on every rank
   because its inputs are.

    trials = PlanTrials([("mgwfbp", plan_a), ("wfbp", plan_b)], steps=3)
    trials.step_ran()                 # a step's exchanges are done; True: switch to trials.index
    trials.record(0.120)              # the period of the step before, timed as the next begins
    ...
    best, timed = trials.decide(comm)     # collective, once trials.finished
"""
import statistics

from horovod_sparse.agreement import max_over_ranks

#: steps each candidate runs before its timed steps
WARMUP_STEPS = 1


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
        self.ran = 0     # steps run so far
        self.times = []  # their periods, seconds, warm-up steps included (the last comes a step late)

    @property
    def per_candidate(self):
        return WARMUP_STEPS + self.steps

    @property
    def total(self):
        return self.per_candidate * len(self.candidates)

    @property
    def index(self):
        """The candidate the next step runs."""
        return min(self.ran // self.per_candidate, len(self.candidates) - 1)

    @property
    def finished(self):
        """Every candidate's every period is in: :meth:`decide`."""
        return len(self.times) >= self.total

    def step_ran(self):
        """A step's exchanges are done; True when its candidate has run all its steps and
        the next candidate takes over (not after the last: it runs on, untimed)."""
        self.ran += 1
        return self.ran % self.per_candidate == 0 and self.ran < self.total

    def record(self, seconds):
        """The period of the step before, timed as the next begins."""
        if not self.finished:
            self.times.append(float(seconds))

    def decide(self, comm):
        """Collective: ``(index of the fastest candidate, [seconds of each timed step, slowest
        rank, per candidate])``, the same on every rank of ``comm``; the fastest has the
        smallest median."""
        slowest = max_over_ranks(comm, self.times).tolist()
        timed = [slowest[i * self.per_candidate + WARMUP_STEPS:(i + 1) * self.per_candidate]
                 for i in range(len(self.candidates))]
        medians = [statistics.median(steps) for steps in timed]
        return min(range(len(medians)), key=medians.__getitem__), timed
