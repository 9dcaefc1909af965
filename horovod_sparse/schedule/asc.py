"""ASC-WFBP's plan: merge gradients into buckets AND run two buckets at once on two
channels (Shi, Chu, Li, INFOCOM'21, "simultaneous communications"), under the
simulator's model: two exchanges in flight overlap their start-ups and share the link,
each moving bytes ``simultaneity`` (k2) times slower than alone.

The paper publishes no code; the planner here is ours, in two steps:

1. A dynamic program over contiguous partitions whose state is "every channel is free
   at time end(i)". From there the next step is either one bucket i..j alone (as in
   :func:`~horovod_sparse.schedule.plans.optimal_plan`) or a pair i..m on channel 0 and
   m..j on channel 1, the second starting as soon as it is ready instead of waiting for
   the first; the pair's end is the simulator's model in closed form. Pairs whose second
   bucket is ready only after the first one ends are skipped (they equal two singles).
   O(L^3) at worst: about 2 s for 160 gradients.
2. The DP's barrier ("every channel free") is pessimistic, and sharing can make a pair
   worse than it looks, so the DP's plan competes, in the simulator, with the
   one-channel optimum (so ASC is never worse than ``optimal`` under the model) and with
   that optimum's buckets and WFBP's alternating between the channels; the earliest step
   end wins, ties going to the earlier candidate (the one-channel optimum first).

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> line = CostModel(a=1.0, b=0.01)
    >>> asc_plan([0.0, 0.0], [100, 100], line, simultaneity=1.0)   # free second channel
    [(0, 1, 0), (1, 2, 1)]
    >>> asc_plan([0.0, 0.0], [100, 100], line, simultaneity=3.0)   # a worse link: merge
    [(0, 2, 0)]
"""
from horovod_sparse.schedule.cost import startup_seconds
from horovod_sparse.schedule.plans import backward_trace, layer_plan, optimal_plan
from horovod_sparse.schedule.simulate import simulate

#: Without a measured factor, assume two flows split the link (simultaneity then only
#: overlaps start-ups): the cautious choice.
UNMEASURED_SIMULTANEITY = 2.0


def asc_plan(compute_times, sizes, cost, channels=2, simultaneity=UNMEASURED_SIMULTANEITY):
    """A plan of ``(start, stop, channel)`` buckets for ``channels`` (1 or 2) channels; see
    the module docstring. ``compute_times`` (seconds of backward before each gradient) and
    ``sizes`` (bytes) are in backward order; ``simultaneity`` is the measured k2 > 0.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> asc_plan([0.0, 0.0], [100, 100], CostModel(1.0, 0.01), channels=1)
    [(0, 2, 0)]
    """
    if channels not in (1, 2):
        raise ValueError(f"channels must be 1 or 2 (asc plans pairs of simultaneous exchanges), got {channels}")
    if not simultaneity > 0:
        raise ValueError(f"simultaneity must be > 0 (k2, measured; 1 to 2 on a shared link), got {simultaneity}")
    ready = backward_trace(compute_times, sizes)
    serial = optimal_plan(compute_times, sizes, cost)
    candidates = [[(a, b, 0) for a, b in serial]]
    if channels == 2:
        candidates += [_pair_dp(ready, sizes, cost, simultaneity), _alternate(serial),
                       _alternate(layer_plan(len(sizes)))]

    def step_end(plan):
        return simulate(ready, sizes, plan, cost, channels=channels, simultaneity=simultaneity).step_end

    ends = [step_end(plan) for plan in candidates]
    return candidates[ends.index(min(ends))]


def _alternate(plan):
    return [(a, b, k % 2) for k, (a, b) in enumerate(plan)]


def _pair_dp(ready, sizes, cost, k2):
    """Step 1 of the module docstring: best[j] = earliest time every channel is free after
    the first j gradients; a step is one bucket alone or a pair at once."""
    count, up = len(sizes), startup_seconds(cost)
    prefix = [0]
    for m in sizes:
        prefix.append(prefix[-1] + m)
    alone = [[float(cost(prefix[j] - prefix[i])) if j > i else 0.0 for j in range(count + 1)] for i in range(count)]
    best, step = [0.0] + [float("inf")] * count, [None] * (count + 1)
    for i in range(count):
        free = best[i]
        for j in range(i + 1, count + 1):
            end = max(ready[j - 1], free) + alone[i][j]
            if end < best[j]:
                best[j], step[j] = end, (i,)
            second = max(ready[j - 1], free)
            for m in range(i + 1, j):
                first = max(ready[m - 1], free)
                if second >= first + alone[i][m]:
                    continue        # no overlap: two singles do the same
                end = _pair_end(first, alone[i][m], second, alone[m][j], up, k2)
                if end < best[j]:
                    best[j], step[j] = end, (i, m)
    plan, j = [], count
    while j > 0:
        cuts = step[j]
        if len(cuts) == 1:
            plan.append((cuts[0], j, 0))
        else:
            plan += [(cuts[1], j, 1), (cuts[0], cuts[1], 0)]
        j = cuts[0]
    return plan[::-1]


def _pair_end(first, first_cost, second, second_cost, startup, k2):
    """When the later of two exchanges started at ``first`` and ``second`` on two channels
    ends: the simulator's model (start-ups overlap, transfers share at 1/k2 speed each) in
    closed form, for speed; tests/unit/test_schedule_planners.py checks it equals
    :func:`simulate`."""
    flows = []
    for begin, total in ((first, first_cost), (second, second_cost)):
        up = min(startup, total)
        flows.append((begin + up, total - up, begin + total))
    (go1, left1, end1), (go2, left2, _) = sorted(flows)
    left1 -= go2 - go1                       # the first transfers alone until the second's start-up is over
    if left1 <= 0.0:
        return max(end1, go2 + left2)
    shared = min(left1, left2)
    return go2 + k2 * shared + (max(left1, left2) - shared)
