"""When each exchange of a step starts and ends: an event-driven simulator.

Gradients become ready during backward (``ready[i]`` seconds after backward starts, in
backward order); a plan groups consecutive gradients into buckets; a bucket is ready
when its last gradient is. Buckets run on ``channels`` communication channels (one by
default: Horovod runs one collective at a time): a bucket pinned to a channel (a plan
of ``(start, stop, channel)`` triples, as :func:`~horovod_sparse.schedule.asc.asc_plan`
makes) waits for that channel, in plan order; an unpinned one (``(start, stop)`` pairs)
is served first come, first served on whichever channel is free first.

The cost of one exchange of M bytes alone is ``cost(M)`` = a start-up ``a`` (the
:class:`~horovod_sparse.schedule.cost.CostModel`'s ``a``, latency that overlaps freely)
plus a transfer ``cost(M) - a`` that shares the link: while n exchanges transfer at once,
each moves at 1 / k(n) of its speed alone, k(n) = n ** log2(k2), where ``simultaneity``
k2 is the measured factor of two (two exchanges of M at once end at a + k2*b*M; k2 = 1:
channels do not interfere, k2 = 2: the link is split fairly, k(n) = n).

Closed forms it reproduces (tests/unit/test_schedule_sim.py, test_schedule_planners.py):

* one bucket: ends at ready + a + b*M;
* buckets all ready at 0 on one channel: end at sum(a + b*M_i);
* on C >= number of buckets channels with k2 = 1: each ends at its ready + its cost;
* two buckets of M ready at 0 on two channels: both end at a + k2*b*M.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> s = simulate(ready=[0.5, 1.0], sizes=[10, 10], plan=[(0, 2)], cost=CostModel(1.0, 0.1))
    >>> s.start, s.end, s.step_end, s.overhead           # ready 1.0 + 1 + 0.1 * 20
    ([1.0], [4.0], 4.0, 3.0)
    >>> two = simulate([0.0, 0.0], [10, 10], [(0, 1, 0), (1, 2, 1)], CostModel(1.0, 0.1),
    ...                channels=2, simultaneity=1.5)
    >>> [round(e, 9) for e in two.end]                   # a + 1.5 * b * M
    [2.5, 2.5]
"""
import math
from dataclasses import dataclass, field

from horovod_sparse.schedule.cost import startup_seconds
from horovod_sparse.schedule.plans import check_plan, threshold_plan

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
        """Total seconds spent communicating (sum of the buckets' costs alone)."""
        return float(sum(self.cost))

    def timeline(self):
        """One row per bucket, for a timeline plot (a lane per channel).

        >>> from horovod_sparse.schedule.cost import CostModel
        >>> simulate([0.0], [10], [(0, 1)], CostModel(1.0, 0.1)).timeline()
        [{'first': 0, 'stop': 1, 'channel': 0, 'ready': 0.0, 'start': 0.0, 'end': 2.0, 'nbytes': 10}]
        """
        return [{"first": r[0], "stop": r[1], "channel": c, "ready": rd, "start": s, "end": e, "nbytes": m}
                for r, c, rd, s, e, m in zip(self.plan, self.channel, self.ready, self.start, self.end,
                                             self.nbytes)]


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


def slowdown(flows, simultaneity):
    """k(n) = n ** log2(k2): how much slower each of ``flows`` simultaneous transfers moves
    than one alone (k(1) = 1, k(2) = k2; each doubling multiplies by k2).

    >>> slowdown(2, 1.5), slowdown(4, 2.0), slowdown(1, 1.5)
    (1.5, 4.0, 1.0)
    """
    return float(flows) ** math.log2(simultaneity) if flows > 1 else 1.0


def simulate(ready, sizes, plan, cost, channels=1, backward_end=None, simultaneity=1.0):
    """Run ``plan``'s buckets on ``channels`` channels (see the module docstring for the
    rules) and return a :class:`Schedule`.

    ``ready`` and ``sizes`` are per gradient; ``cost(nbytes)`` gives a bucket's seconds
    alone; ``backward_end`` defaults to the last ready time; ``simultaneity`` is k2 > 0.
    """
    if len(ready) != len(sizes):
        raise ValueError("ready and sizes must have one entry per gradient")
    if channels < 1:
        raise ValueError(f"channels must be >= 1, got {channels}")
    if not simultaneity > 0:
        raise ValueError(f"simultaneity must be > 0 (k2, measured; 1 to 2 on a shared link), got {simultaneity}")
    check_plan(plan, len(sizes), channels)
    ranges = [(b[0], b[1]) for b in plan]
    pins = [b[2] for b in plan] if plan and len(plan[0]) == 3 else None
    b_ready = [max(ready[i] for i in range(a, b)) for a, b in ranges]
    b_bytes = [sum(sizes[a:b]) for a, b in ranges]
    costs = [float(cost(m)) for m in b_bytes]
    up = startup_seconds(cost)
    start, end, chan = _serve(b_ready, [max(0.0, min(up, c)) for c in costs], costs, pins, channels, simultaneity)
    bk_end = max(ready, default=0.0) if backward_end is None else backward_end
    return Schedule(ranges, b_bytes, b_ready, start, end, chan, bk_end, costs)


def _serve(ready, startup, cost, pins, channels, k2):
    """The event loop: returns per bucket (start, end, channel). Between two events every
    running bucket advances either its start-up (at wall-clock speed) or its transfer (at
    1/k(n) speed, n = buckets transferring); an event is a phase ending or a bucket
    becoming ready for an idle channel."""
    n = len(ready)
    if pins is None:       # one shared FIFO queue, by ready time then plan order
        shared = sorted(range(n), key=lambda k: (ready[k], k))
        queues = None
    else:                  # each channel runs its own buckets in plan order
        queues = [[k for k in range(n) if pins[k] == c] for c in range(channels)]
    start, end, chan = [0.0] * n, [0.0] * n, [0] * n
    running = {}                        # channel -> [bucket, start-up left, transfer left]
    free_since = [0.0] * channels
    t, done = 0.0, 0

    def head(c):
        q = shared if queues is None else queues[c]
        return q[0] if q else None

    while done < n:
        for c in sorted((c for c in range(channels) if c not in running), key=lambda c: (free_since[c], c)):
            k = head(c)
            if k is not None and ready[k] <= t + _EPS:
                (shared if queues is None else queues[c]).pop(0)
                start[k], chan[k] = max(t, ready[k]), c
                running[c] = [k, startup[k], cost[k] - startup[k]]
        slow = slowdown(sum(1 for r in running.values() if r[1] <= 0.0), k2)
        due = {c: t + (r[1] if r[1] > 0.0 else r[2] * slow) for c, r in running.items()}
        waiting = [ready[k] for k in (head(c) for c in range(channels) if c not in running) if k is not None]
        t_next = min(list(due.values()) + [w for w in waiting if w > t + _EPS])
        dt = t_next - t
        for c, r in list(running.items()):
            if due[c] <= t_next + _EPS:          # this phase ends now
                if r[1] > 0.0 and r[2] > 0.0:
                    r[1] = 0.0
                    continue
                end[r[0]], free_since[c] = t_next, t_next
                del running[c]
                done += 1
            elif r[1] > 0.0:
                r[1] -= dt
            else:
                r[2] -= dt / slow
        t = t_next
    return start, end, chan


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
