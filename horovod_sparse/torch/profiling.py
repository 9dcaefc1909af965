"""What a schedule is planned from, measured during the first steps of training.

* :class:`ArrivalTrace`: when each gradient reaches ``compress`` (Horovod's hooks fire as
  backward produces them), per step; the backward trace is the median over the profiled
  steps, the first (warm-up) left out.
* :func:`fit_exchange_cost`: a + b*M fitted on the very path the plan will use: the
  compressor's own pipeline (:class:`~horovod_sparse.torch.buckets.Bucket`) on a channel's
  communicator, exchanging copies of the step's gradient values at geometric sizes (the
  first M bytes of them in backward order; whole gradients for a compressor whose cost
  depends on their shapes, PowerSGD), in throwaway pipelines (no residual changes); with
  two channels, also the
  simultaneity factor k2 of two such exchanges at once. Every time is the max over ranks
  (an exchange ends when its slowest rank does), median over repeats: the same numbers
  on every rank.
"""
import statistics
import time

import numpy as np
import torch

from horovod_sparse.agreement import max_over_ranks
from horovod_sparse.schedule.cost import CostModel, fit_simultaneity
from horovod_sparse.torch.buckets import Bucket

#: first probe size (bytes), then x4 up to the whole step
FIRST_PROBE_BYTES = 64 * 1024
PROBE_FACTOR = 4


class ArrivalTrace:
    """Arrival times of the gradients at ``compress``, step by step."""

    def __init__(self):
        self.steps = []      # [(arrivals [(key, t)], t of the step's first decompress)]
        self._current = []

    def arrived(self, key):
        self._current.append((key, time.perf_counter()))

    def end_step(self):
        """The step's first ``decompress``: backward (and Horovod's synchronize) are over."""
        self.steps.append((self._current, time.perf_counter()))
        self._current = []

    def backward_trace(self, keys):
        """``(order, compute_times, tail_s)`` of the gradients ``keys``: their order in the
        last step, the median seconds of backward before each (0 for the first: backward's
        start is not seen) and from the last to the first ``decompress``."""
        keep = set(keys)
        profiled = self.steps[1:] or self.steps
        order = [k for k, _ in profiled[-1][0] if k in keep]
        gaps, tails = {k: [] for k in order}, []
        for arrivals, end in profiled:
            times = dict((k, t) for k, t in arrivals if k in keep)
            if set(times) != keep:
                continue
            for previous, key in zip(order, order[1:]):
                gaps[key].append(max(0.0, times[key] - times[previous]))
            tails.append(max(0.0, end - max(times.values())))
        compute = [0.0] + [statistics.median(gaps[k]) if gaps[k] else 0.0 for k in order[1:]]
        return order, compute, (statistics.median(tails) if tails else 0.0)


def probe_prefixes(sizes):
    """Lengths of the prefixes of ``sizes`` (bytes, backward order) closest above each
    geometric target from :data:`FIRST_PROBE_BYTES` (x :data:`PROBE_FACTOR`) to their sum."""
    total, cumulative = sum(sizes), np.cumsum(sizes)
    ends, target = [], FIRST_PROBE_BYTES
    while target < total:
        ends.append(int(np.searchsorted(cumulative, target)) + 1)
        target *= PROBE_FACTOR
    ends.append(len(sizes))
    return sorted(set(ends))


def probe_lengths(n):
    """Geometric buffer lengths (elements) from :data:`FIRST_PROBE_BYTES` (x
    :data:`PROBE_FACTOR`) up to ``n``, and ``n``."""
    lengths, m = [], FIRST_PROBE_BYTES // 4
    while m < n:
        lengths.append(m)
        m *= PROBE_FACTOR
    return lengths + [n]


def _timed(comm, run, repeats):
    """Median over ``repeats`` (after one warm-up) of the slowest rank's seconds of ``run()``."""
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(statistics.median(max_over_ranks(comm, times)[1:]))


def fit_exchange_cost(algorithm, order, gradients, channels, name, repeats=3):
    """Fit the cost of one bucket's exchange (see the module docstring).

    order: gradient keys in backward order; gradients: key -> tensor (copied, not changed);
    channels: [(communicator, thread)] (one or two). Returns a dict with ``cost``
    (:class:`CostModel`, a and b clamped at >= 0), ``r2``, ``points`` ([bytes, seconds]),
    and ``simultaneity`` (k2, or None with one channel), ``simultaneity_r2``.
    """
    sizes = [4 * gradients[k].numel() for k in order]
    if getattr(algorithm, "per_matrix", False):  # its cost depends on the shapes: whole gradients
        copies = {k: gradients[k].detach().clone() for k in order}
        probes = [(order[:length], sum(sizes[:length])) for length in probe_prefixes(sizes)]
    else:  # any size: the first m values of the step's gradients, as one buffer
        fused = torch.cat([gradients[k].detach().reshape(-1).float() for k in order])
        lengths = probe_lengths(fused.numel())
        copies = {f"(probe {m})": fused[:m].clone() for m in lengths}
        probes = [([f"(probe {m})"], 4 * m) for m in lengths]

    def probe(keys, comm):
        bucket = Bucket(algorithm, keys)
        return bucket, (lambda: bucket.exchange(copies, {}, comm, name))

    points, buckets = [], []
    comm = channels[0][0]
    for keys, nbytes in probes:
        bucket, run = probe(keys, comm)
        buckets.append(bucket)
        points.append([nbytes, _timed(comm, run, repeats)])
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
            together.append(_timed(comm, both, repeats))
        try:
            fit["simultaneity"], fit["simultaneity_r2"] = fit_simultaneity(
                [p[0] for p in points[-2:]], [p[1] for p in points[-2:]], together)
        except ValueError:  # the exchanges alone did not grow with size: k2 unmeasurable
            pass
    for bucket in buckets:
        bucket.close()
    return fit
