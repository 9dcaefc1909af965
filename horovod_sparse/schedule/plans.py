"""Bucket plans: which consecutive gradients (in backward order) travel together.

A plan is a list of half-open index ranges ``(start, stop)`` that cover ``0..L``
contiguously, in order; a plan for several channels pins each bucket to one with
triples ``(start, stop, channel)``. Horovod's own rule (a background loop that fuses whatever is
ready every cycle) depends on when the exchanges end, so it is not a static plan: see
:func:`horovod_sparse.schedule.simulate.simulate_cycles`.

    >>> layer_plan(3), single_plan(3)
    ([(0, 1), (1, 2), (2, 3)], [(0, 3)])
    >>> netai_plan(waits=[0.004, 0.002, 0.001], sizes=[10, 10, 10])   # 5 ms of backward
    [(0, 2), (2, 3)]

Planned from a backward trace and a cost model (one channel, FIFO, as Horovod runs):
``mgwfbp_plan`` (MG-WFBP's greedy merge) and ``optimal_plan`` (the exact dynamic
program under the same model); several channels: :mod:`horovod_sparse.schedule.asc`.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> line = CostModel(a=2.0, b=0.0)          # start-up dominates: merge everything
    >>> mgwfbp_plan([1, 1, 1], [1, 1, 1], line), optimal_plan([1, 1, 1], [1, 1, 1], line)
    ([(0, 3)], [(0, 3)])
"""
from itertools import accumulate

from horovod_sparse.schedule.cost import startup_seconds

#: The NetAI'20 simulator's flush rule (Horovod's old defaults): 5 ms of backward, 64 MiB.
NETAI_TIMEOUT_S = 0.005
NETAI_LIMIT_BYTES = 64 * 1024 * 1024


def layer_plan(count):
    """One bucket per gradient (wait-free backprop, WFBP)."""
    return [(i, i + 1) for i in range(count)]


#: WFBP's name for the layer plan.
wfbp_plan = layer_plan


def single_plan(count):
    """One bucket with every gradient, sent when backward is done."""
    return [(0, count)] if count else []


def netai_plan(waits, sizes, timeout_s=NETAI_TIMEOUT_S, limit_bytes=NETAI_LIMIT_BYTES):
    """The NetAI'20 rule: after each gradient add its backward wait and bytes to the open
    bucket; close the bucket once its accumulated wait reaches ``timeout_s`` or its bytes
    ``limit_bytes``; the rest is one bucket at the end."""
    plan, start, acc_time, acc_bytes = [], 0, 0.0, 0
    for i, (wait, size) in enumerate(zip(waits, sizes)):
        acc_time += wait
        acc_bytes += size
        if acc_time >= timeout_s or acc_bytes >= limit_bytes:
            plan.append((start, i + 1))
            start, acc_time, acc_bytes = i + 1, 0.0, 0
    if start < len(sizes):
        plan.append((start, len(sizes)))
    return plan


def threshold_plan(sizes, limit_bytes):
    """Consecutive gradients fused up to ``limit_bytes`` (one larger than the limit goes
    alone), as Horovod's fusion buffer does within one cycle."""
    plan, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and acc + size > limit_bytes:
            plan.append((start, i))
            start, acc = i, 0
        acc += size
    if start < len(sizes):
        plan.append((start, len(sizes)))
    return plan


def check_plan(plan, count, channels=1):
    """ValueError unless ``plan`` covers ``0..count`` with contiguous non-empty ranges, all
    pairs or all triples whose channel is in ``0..channels-1``."""
    expected, arity = 0, {len(b) for b in plan}
    if arity - {2, 3} or len(arity) > 1:
        raise ValueError(f"a plan is all (start, stop) pairs or all (start, stop, channel) triples, got {plan}")
    for bucket in plan:
        start, stop = bucket[0], bucket[1]
        if start != expected or stop <= start:
            raise ValueError(f"a plan must cover 0..{count} with contiguous non-empty ranges, got {plan}")
        if len(bucket) == 3 and not 0 <= bucket[2] < channels:
            raise ValueError(f"a bucket's channel must be in 0..{channels - 1}, got {bucket}")
        expected = stop
    if expected != count:
        raise ValueError(f"a plan must cover 0..{count} with contiguous non-empty ranges, got {plan}")


def backward_trace(compute_times, sizes):
    """Ready times (cumulative ``compute_times``, seconds of backward before each gradient,
    in backward order) after checking the trace; ValueError names what is wrong."""
    if len(compute_times) != len(sizes):
        raise ValueError("compute_times and sizes must have one entry per gradient")
    if any(not t >= 0 for t in compute_times):
        raise ValueError(f"compute_times must be >= 0 seconds, got {list(compute_times)}")
    if any(not m >= 0 for m in sizes):
        raise ValueError(f"sizes must be >= 0 bytes, got {list(sizes)}")
    return [float(t) for t in accumulate(compute_times)]


def mgwfbp_plan(compute_times, sizes, cost):
    """MG-WFBP's greedy merge (Shi et al., INFOCOM'19; the reference's
    ``_generate_groups_mgwfbp``), in backward order: exchanges run one at a time, FIFO, as
    soon as their bucket is ready. Walking from the first gradient ready, gradient i is
    merged into the next one's bucket when the next is ready before i's exchange would
    end and i's exchange either has not started yet or started less than the start-up
    ``a`` before (waiting costs less than the ``a`` a merge saves). After each merge the
    exchange times are recomputed with the merged bucket's cost.

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> mgwfbp_plan([0.0, 0.5, 1.0], [3, 1, 1], CostModel(a=0.1, b=1.0))
    [(0, 1), (1, 3)]
    """
    ready = backward_trace(compute_times, sizes)
    count, a = len(sizes), startup_seconds(cost)
    merged = list(sizes)                 # bytes of the bucket that ends at gradient i
    comm = [float(cost(m)) for m in sizes]   # 0 once merged into the next

    def comm_start():
        out, free = [], 0.0
        for i in range(count):
            out.append(max(free, ready[i]))
            free = out[-1] + comm[i]
        return out

    plan, first, start = [], 0, comm_start()
    for i in range(count - 1):
        nxt = ready[i + 1]
        if nxt < start[i] + comm[i] and (start[i] > nxt or nxt - start[i] < a):
            merged[i + 1] += merged[i]
            merged[i], comm[i], comm[i + 1] = 0, 0.0, float(cost(merged[i + 1]))
            start = comm_start()
        else:
            plan.append((first, i + 1))
            first = i + 1
    return plan + [(first, count)] if count else plan


def optimal_plan(compute_times, sizes, cost):
    """The best contiguous partition under MG-WFBP's model (one channel, FIFO), exactly:
    end(j) = min over i < j of max(ready(j), end(i)) + cost(bytes(i..j)) is when the best
    plan of the first j gradients finishes (its last bucket is i..j). O(L^2) cost calls.
    Ties go to the larger last bucket (fewer exchanges).

    >>> from horovod_sparse.schedule.cost import CostModel
    >>> optimal_plan([0.0, 0.5, 1.0], [3, 1, 1], CostModel(a=0.1, b=1.0))
    [(0, 1), (1, 3)]
    """
    ready = backward_trace(compute_times, sizes)
    count = len(sizes)
    best, cut = [0.0] * (count + 1), [0] * (count + 1)
    for j in range(1, count + 1):
        best[j], nbytes = float("inf"), 0
        for i in range(j - 1, -1, -1):
            nbytes += sizes[i]
            end = max(ready[j - 1], best[i]) + float(cost(nbytes))
            if end <= best[j]:
                best[j], cut[j] = end, i
    plan, j = [], count
    while j > 0:
        plan.append((cut[j], j))
        j = cut[j]
    return plan[::-1]
