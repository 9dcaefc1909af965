"""What a schedule is planned from, measured during the first steps of training.

* :class:`ArrivalTrace`: when each gradient reaches ``compress`` (Horovod's hooks fire as
  backward produces them), per step; the backward trace is the median over the profiled
  steps, the first (warm-up) left out.
* :func:`fit_exchange_cost`: a + b*M fitted on the very path the plan will use: the
  compressor's own pipeline (:class:`~horovod_sparse.step.bucket.Bucket`) on a channel's
  communicator, exchanging copies of the step's gradient values at geometric sizes (the
  first M bytes of them in backward order; whole gradients for a compressor whose cost
  depends on their shapes, PowerSGD), in throwaway pipelines (no residual changes); with
  two channels, also the
  simultaneity factor k2 of two such exchanges at once. Every time is the max over ranks
  (an exchange ends when its slowest rank does), median over repeats: the same numbers
  on every rank.
"""
import numpy as np

from horovod_sparse.agreement import time_collective
from horovod_sparse.schedule.arrivals import ArrivalTrace  # noqa: F401 (profiled here)
from horovod_sparse.schedule.cost import CostModel, fit_simultaneity
from horovod_sparse.step.bucket import Bucket

#: first probe size (bytes), then x4 up to the whole step
FIRST_PROBE_BYTES = 64 * 1024
PROBE_FACTOR = 4


def probe_prefixes(sizes, factor=PROBE_FACTOR):
    """Lengths of the prefixes of ``sizes`` (bytes, backward order) closest above each
    geometric target from :data:`FIRST_PROBE_BYTES` (x ``factor``) to their sum."""
    total, cumulative = sum(sizes), np.cumsum(sizes)
    ends, target = [], FIRST_PROBE_BYTES
    while target < total:
        ends.append(int(np.searchsorted(cumulative, target)) + 1)
        target *= factor
    ends.append(len(sizes))
    return sorted(set(ends))


def probe_lengths(n, factor=PROBE_FACTOR):
    """Geometric buffer lengths (elements) from :data:`FIRST_PROBE_BYTES` (x ``factor``) up
    to ``n``, and ``n``."""
    lengths, m = [], FIRST_PROBE_BYTES // 4
    while m < n:
        lengths.append(m)
        m *= factor
    return lengths + [n]


def fit_exchange_cost(algorithm, arrays, order, gradients, channels, name, repeats=3, factor=PROBE_FACTOR,
                      max_bytes=None):
    """Fit the cost of one bucket's exchange (see the module docstring).

    arrays: the frontend's step arrays (:mod:`horovod_sparse.step.bucket`);
    order: gradient keys in backward order; gradients: key -> tensor (copied, not changed);
    channels: [(communicator, thread)] (one or two); factor: between probe sizes (fewer
    probes, a coarser fit); max_bytes: the largest probe (the line goes on beyond it; a
    sparsifier's first step on a new buffer is an exact selection, seconds on 100 MB).
    Returns a dict with ``cost``
    (:class:`CostModel`, a and b clamped at >= 0), ``r2``, ``points`` ([bytes, seconds]),
    and ``simultaneity`` (k2, or None with one channel), ``simultaneity_r2``.
    """
    sizes = [4 * arrays.numel(gradients[k]) for k in order]
    if max_bytes is not None:  # the gradients up to the largest probe, the one that crosses it included
        order = order[:int(np.searchsorted(np.cumsum(sizes), max_bytes)) + 1]
        sizes = sizes[:len(order)]
    if getattr(algorithm, "per_matrix", False):  # its cost depends on the shapes: whole gradients
        copies = {k: arrays.copy(gradients[k]) for k in order}
        probes = [(order[:length], sum(sizes[:length])) for length in probe_prefixes(sizes, factor)]
    else:  # any size: the first m values of the step's gradients, as one buffer
        fused = arrays.fused_copy([gradients[k] for k in order])
        n = fused.shape[0] if max_bytes is None else min(fused.numel(), max_bytes // 4)
        lengths = probe_lengths(n, factor)
        copies = {f"(probe {m})": arrays.copy(fused[:m]) for m in lengths}
        probes = [([f"(probe {m})"], 4 * m) for m in lengths]

    def probe(keys, comm):
        bucket = Bucket(algorithm, arrays, keys)
        return bucket, (lambda: bucket.exchange(copies, {}, comm, name))

    points, buckets = [], []
    comm = channels[0][0]
    for keys, nbytes in probes:
        bucket, run = probe(keys, comm)
        buckets.append(bucket)
        points.append([nbytes, time_collective(comm, run, repeats)])
    fit = {"points": points}
    if len(points) >= 2:
        line, fit["r2"] = CostModel.fit(*zip(*points))
    else:  # one gradient: all start-up
        line, fit["r2"] = CostModel(points[0][1], 0.0), 1.0
    fit["cost"] = CostModel(max(line.a, 0.0), max(line.b, 0.0))
    fit["simultaneity"] = fit["simultaneity_r2"] = None
    if len(channels) >= 2 and len(points) >= 2:
        together = []
        for keys, _ in probes[-2:]:
            pair = [probe(keys, c) for c, _ in channels[:2]]
            buckets += [b for b, _ in pair]

            def both():
                futures = [thread.submit(run) for (_, thread), (_, run) in zip(channels, pair)]
                for f in futures:
                    f.result()
            together.append(time_collective(comm, both, repeats))
        try:
            fit["simultaneity"], fit["simultaneity_r2"] = fit_simultaneity(
                [p[0] for p in points[-2:]], [p[1] for p in points[-2:]], together)
        except ValueError:  # the exchanges alone did not grow with size: k2 unmeasurable
            pass
    for bucket in buckets:
        bucket.close()
    return fit
