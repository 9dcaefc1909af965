"""When each exchange of a step starts and ends: an event-driven simulator.

Gradients become ready during backward (``ready[i]`` seconds after backward starts, in
backward order); a plan groups consecutive gradients into buckets; a bucket is ready
when its last gradient is; buckets are served first come, first served on ``channels``
communication channels (one by default: Horovod runs one collective at a time), each
taking ``cost(bucket bytes)`` seconds.

Closed forms it reproduces (tests/unit/test_schedule_sim.py):

* one bucket: ends at ready + a + b*M;
* buckets all ready at 0 on one channel: end at sum(a + b*M_i);
* on C >= number of buckets channels: each ends at its ready + its cost.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> s = simulate(ready=[0.5, 1.0], sizes=[10, 10], plan=[(0, 2)], cost=CostModel(1.0, 0.1))
    >>> s.start, s.end, s.step_end, s.overhead           # ready 1.0 + 1 + 0.1 * 20
    ([1.0], [4.0], 4.0, 3.0)
"""
import math
from dataclasses import dataclass, field

from horovod_sparse.schedule.plans import threshold_plan

# Ready times come from sums of floats: "ready at the tick" must survive rounding.
_EPS = 1e-12


@dataclass
class Schedule:
    """The simulated step: per bucket (in plan order) its gradient range, bytes, ready,
    start and end times and channel; ``backward_end`` is when backward finished."""

    plan: list
    nbytes: list
    ready: list
    start: list
    end: list
    channel: list
    backward_end: float
    cost: list = field(default_factory=list)

    @property
    def step_end(self):
        """When the last exchange (or backward, if later) ends."""
        return max([self.backward_end] + list(self.end))

    @property
    def overhead(self):
        """Communication time not hidden behind backward: step_end - backward_end."""
        return self.step_end - self.backward_end

    @property
    def busy(self):
        """Total seconds spent communicating (sum of the buckets' costs)."""
        return float(sum(self.cost))


def ready_times(waits, start=0.0):
    """Cumulative sums: the time each gradient is ready, given the backward compute before it.

    >>> ready_times([1.0, 0.5, 0.25])
    [1.0, 1.5, 1.75]
    """
    out, now = [], float(start)
    for w in waits:
        now += float(w)
        out.append(now)
    return out


def _check_plan(plan, count):
    expected = 0
    for start, stop in plan:
        if start != expected or stop <= start:
            raise ValueError(f"a plan must cover 0..{count} with contiguous non-empty ranges, got {plan}")
        expected = stop
    if expected != count:
        raise ValueError(f"a plan must cover 0..{count} with contiguous non-empty ranges, got {plan}")


def simulate(ready, sizes, plan, cost, channels=1, backward_end=None):
    """Serve ``plan``'s buckets FIFO (by ready time, then plan order) on ``channels``
    channels: a bucket starts at max(its ready time, the earliest free channel).

    ``ready`` and ``sizes`` are per gradient; ``cost(nbytes)`` gives a bucket's seconds;
    ``backward_end`` defaults to the last ready time. Returns a :class:`Schedule`.
    """
    if len(ready) != len(sizes):
        raise ValueError("ready and sizes must have one entry per gradient")
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    _check_plan(plan, len(sizes))
    b_ready = [max(ready[i] for i in range(a, b)) for a, b in plan]
    b_bytes = [sum(sizes[a:b]) for a, b in plan]
    free = [0.0] * channels
    start, end, chan, costs = [0.0] * len(plan), [0.0] * len(plan), [0] * len(plan), [0.0] * len(plan)
    for k in sorted(range(len(plan)), key=lambda k: (b_ready[k], k)):
        c = min(range(channels), key=lambda c: (free[c], c))
        costs[k] = float(cost(b_bytes[k]))
        start[k] = max(b_ready[k], free[c])
        end[k] = free[c] = start[k] + costs[k]
        chan[k] = c
    bk_end = max(ready, default=0.0) if backward_end is None else backward_end
    return Schedule(list(plan), b_bytes, b_ready, start, end, chan, bk_end, costs)


def simulate_cycles(ready, sizes, cost, cycle_s, threshold_bytes, backward_end=None):
    """Horovod's background loop: a cycle starts every ``cycle_s`` (the first at 0) or when
    the previous cycle's collectives are done, whichever is later; it fuses every gradient
    ready by then into buckets of at most ``threshold_bytes`` and runs them one after the
    other. The plan is what those cycles formed. ``ready`` must be non-decreasing.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> s = simulate_cycles([0.0, 0.0, 2.5], [1, 1, 1], CostModel(1.0, 0.0), 1.0, 10)
    >>> s.plan, s.start, s.end          # ticks at 0, 1, 2, 3: the third is sent at 3
    ([(0, 2), (2, 3)], [0.0, 3.0], [1.0, 4.0])
    """
    if len(ready) != len(sizes):
        raise ValueError("ready and sizes must have one entry per gradient")
    if any(b < a for a, b in zip(ready, ready[1:])):
        raise ValueError("ready times must be non-decreasing (backward order)")
    if cycle_s < 0 or threshold_bytes <= 0:
        raise ValueError("cycle_s must be >= 0 and threshold_bytes > 0")
    plan, b_bytes, b_ready, start, end, costs = [], [], [], [], [], []
    tick, free, i, n = 0.0, 0.0, 0, len(sizes)
    while i < n:
        if ready[i] > tick + _EPS:   # idle cycles until the next gradient is ready
            tick = tick + math.ceil((ready[i] - tick) / cycle_s - _EPS) * cycle_s if cycle_s > 0 else ready[i]
        j = i
        while j < n and ready[j] <= tick + _EPS:
            j += 1
        for a, b in threshold_plan(sizes[i:j], threshold_bytes):
            a, b = a + i, b + i
            size = sum(sizes[a:b])
            plan.append((a, b))
            b_bytes.append(size)
            b_ready.append(max(ready[a:b]))
            costs.append(float(cost(size)))
            start.append(max(tick, free))
            free = start[-1] + costs[-1]
            end.append(free)
        i = j
        tick = max(tick + cycle_s, free)
    bk_end = max(ready, default=0.0) if backward_end is None else backward_end
    return Schedule(plan, b_bytes, b_ready, start, end, [0] * len(plan), bk_end, costs)
