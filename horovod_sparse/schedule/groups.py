"""A plan for users who keep Horovod's own dense allreduce: Horovod 0.28.1's ``groups=``
plus the two environment variables that make each group exactly one allreduce.

A group is sent as one request when its last gradient arrives;
``HOROVOD_DISABLE_GROUP_FUSION=1`` stops the background loop from fusing several ready
groups together, and ``HOROVOD_FUSION_THRESHOLD`` (bytes, default 128 MiB) must hold the
largest group or Horovod splits it. Both are read at ``hvd.init()``. Horovod runs one
allreduce at a time, so a plan's channels (ASC) are dropped here.

    >>> names = ["fc2.bias", "fc2.weight", "fc1.bias"]          # backward order
    >>> groups, env = horovod_groups([(0, 1), (1, 3)], names, sizes=[40, 4000, 200 * 2 ** 20])
    >>> groups, env["HOROVOD_FUSION_THRESHOLD"]
    ([['fc2.bias'], ['fc2.weight', 'fc1.bias']], '209719200')
    >>> plan_from_groups(groups, names)
    [(0, 1), (1, 3)]

With PyTorch pass the parameters themselves (in backward order, the order of the trace):
``hvd.DistributedOptimizer(opt, named_parameters=..., groups=groups)`` after setting
``os.environ.update(env)`` before ``hvd.init()``.
"""
from horovod_sparse.schedule.plans import check_plan

#: Horovod 0.28.1's default fusion buffer.
HOROVOD_FUSION_DEFAULT = 128 * 1024 * 1024


def horovod_groups(plan, params, sizes):
    """``(groups, env)``: one list of ``params`` items per bucket of ``plan`` (any objects:
    names, torch parameters, tf variables; in backward order, one per gradient), and the
    environment variables, as strings, given each gradient's ``sizes`` in bytes."""
    if len(params) != len(sizes):
        raise ValueError("params and sizes must have one entry per gradient")
    ranges = [(b[0], b[1]) for b in plan]
    check_plan(ranges, len(params))
    groups = [list(params[a:b]) for a, b in ranges]
    largest = max((sum(sizes[a:b]) for a, b in ranges), default=0)
    env = {"HOROVOD_DISABLE_GROUP_FUSION": "1",
           "HOROVOD_FUSION_THRESHOLD": str(int(max(largest, HOROVOD_FUSION_DEFAULT)))}
    return groups, env


def plan_from_groups(groups, params):
    """The plan of ``groups`` over ``params`` (backward order); items are matched by
    identity, so pass the same objects. ValueError unless the groups are contiguous runs
    covering every item once, in order."""
    index = {id(p): i for i, p in enumerate(params)}
    plan, expected = [], 0
    for group in groups:
        at = [index.get(id(p)) for p in group]
        if not group or None in at or sorted(at) != list(range(expected, expected + len(group))):
            raise ValueError("groups must be contiguous runs of params, in backward order, covering each once")
        plan.append((expected, expected + len(group)))
        expected += len(group)
    check_plan(plan, len(params))
    return plan
