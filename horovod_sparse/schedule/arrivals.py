"""When each gradient of a step arrives, step by step: the backward trace a plan is made from
(``schedule=`` in PyTorch, ``Compression.auto`` in both frameworks)."""
import statistics
import time


class ArrivalTrace:
    """Arrival times of the gradients at ``compress``, step by step."""

    def __init__(self):
        self.steps = []      # [(arrivals [(key, t)], t of the step's first decompress)]
        self._current = []

    def arrived(self, key, at=None):
        """``key`` arrived now (or at ``at``, seconds of ``time.perf_counter``)."""
        self._current.append((key, time.perf_counter() if at is None else at))

    def end_step(self, at=None):
        """The step's first ``decompress``: backward (and Horovod's synchronize) are over."""
        self.steps.append((self._current, time.perf_counter() if at is None else at))
        self._current = []

    def discard_step(self):
        """Forget the current step's arrivals (a step skipped for a non-finite gradient)."""
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
