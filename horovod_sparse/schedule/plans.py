"""Bucket plans: which consecutive gradients (in backward order) travel together.

A plan is a list of half-open index ranges ``(start, stop)`` that cover ``0..L``
contiguously, in order. Horovod's own rule (a background loop that fuses whatever is
ready every cycle) depends on when the exchanges end, so it is not a static plan: see
:func:`horovod_sparse.schedule.simulate.simulate_cycles`.

    >>> layer_plan(3), single_plan(3)
    ([(0, 1), (1, 2), (2, 3)], [(0, 3)])
    >>> netai_plan(waits=[0.004, 0.002, 0.001], sizes=[10, 10, 10])   # 5 ms of backward
    [(0, 2), (2, 3)]
"""

#: The NetAI'20 simulator's flush rule (Horovod's old defaults): 5 ms of backward, 64 MiB.
NETAI_TIMEOUT_S = 0.005
NETAI_LIMIT_BYTES = 64 * 1024 * 1024


def layer_plan(count):
    """One bucket per gradient (wait-free backprop, WFBP)."""
    return [(i, i + 1) for i in range(count)]


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
