"""What one exchange of M bytes costs: a fitted line a + b*M, a ring allreduce built from a
link's bandwidth and latency, or a measured table; and how much two exchanges at once slow
each other (the simultaneity factor k2).

Every cost here is a callable ``cost(nbytes) -> seconds``, so the simulator takes any of
them (or a plain function).

    >>> line, r2 = CostModel.fit([1e6, 2e6, 4e6], [0.011, 0.021, 0.041])
    >>> round(line.a, 6), round(line.b * 1e9, 3), round(r2, 6)
    (0.001, 10.0, 1.0)
    >>> k2, r2 = fit_simultaneity([1e6, 4e6], alone=[0.011, 0.041], together=[0.016, 0.061])
    >>> round(k2, 6)                     # two at once move bytes 1.5x slower than one alone
    1.5
    >>> ring = RingAllreduce(bandwidth_bps=10e9, latency_s=0.0, workers=4)
    >>> round(ring(100e6), 4)            # 2 * 100 MB * 3/4 * 8 bits / 10 Gbit/s
    0.12
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CostModel:
    """t(M) = a + b * M: ``a`` seconds of start-up, ``b`` seconds per byte."""

    a: float = 0.0
    b: float = 0.0

    def __call__(self, nbytes):
        return self.a + self.b * nbytes

    @classmethod
    def fit(cls, sizes, times):
        """Least-squares line through ``(sizes[i], times[i])``; returns ``(CostModel, r2)``.

        R^2 = 1 - SS_res / SS_tot (1.0 for a perfect fit; 1.0 too when every time is equal
        and the fit is exact). One size alone cannot separate a from b: ValueError.
        """
        x = np.asarray(sizes, dtype=np.float64)
        y = np.asarray(times, dtype=np.float64)
        if x.shape != y.shape or x.ndim != 1:
            raise ValueError("sizes and times must be 1-D and of equal length")
        if np.unique(x).size < 2:
            raise ValueError("fitting a + b*M needs at least two distinct sizes")
        b, a = np.polyfit(x, y, 1)
        residual = float(np.sum((y - (a + b * x)) ** 2))
        total = float(np.sum((y - y.mean()) ** 2))
        r2 = 1.0 - residual / total if total > 0 else (1.0 if residual <= 1e-30 else 0.0)
        return cls(float(a), float(b)), r2


def startup_seconds(cost):
    """The start-up part of an exchange's cost (latency, overlapped by simultaneous
    exchanges): ``cost.a`` for a line, else ``cost(0)``."""
    a = getattr(cost, "a", None)
    return float(cost(0) if a is None else a)


def fit_simultaneity(sizes, alone, together):
    """The factor k2 of two simultaneous exchanges, from paired measurements: at each size
    M, ``alone`` = seconds of one exchange of M, ``together`` = seconds until both of two
    exchanges of M started at once are done. Model: alone = a + b*M, together = a + k2*b*M,
    so k2 is the ratio of the two fitted slopes. Returns ``(k2, r2 of the together fit)``.
    k2 = 1: the channels do not interfere; 2: they split the link; between: the paper's
    ~1.5.
    """
    one, _ = CostModel.fit(sizes, alone)
    two, r2 = CostModel.fit(sizes, together)
    if not one.b > 0:
        raise ValueError(f"the exchanges alone must grow with size to fit k2 (fitted b = {one.b})")
    return two.b / one.b, r2


@dataclass(frozen=True)
class TableCost:
    """A measured cost, linearly interpolated between measured sizes and clamped outside
    them (``np.interp``), e.g. a vector addition timed at a few sizes."""

    sizes: tuple
    times: tuple

    def __post_init__(self):
        if len(self.sizes) != len(self.times) or not self.sizes:
            raise ValueError("a cost table needs as many times as sizes, at least one")
        order = np.argsort(self.sizes)
        object.__setattr__(self, "sizes", tuple(float(self.sizes[i]) for i in order))
        object.__setattr__(self, "times", tuple(float(self.times[i]) for i in order))

    def __call__(self, nbytes):
        return float(np.interp(nbytes, self.sizes, self.times))


@dataclass(frozen=True)
class RingAllreduce:
    """Ring allreduce of M bytes on ``workers`` ranks: 2(P-1) steps, each sending M/P bytes
    and paying ``latency_s``; the P-1 reduce-scatter steps also add two M/P vectors.

    t(M) = 2(P-1) * latency + 2 M (P-1)/P * 8 / (bandwidth * ratio) + (P-1) * reduce(M/P)

    ``bandwidth_bps`` is bits per second (10 Gbit/s = 10e9), ``ratio`` divides the bytes on
    the wire but not the reduction (the NetAI'20 model's compression ratio), ``reduce`` is
    a cost callable of the added bytes (None: free). One worker costs nothing.
    """

    bandwidth_bps: float
    latency_s: float = 0.0
    workers: int = 2
    ratio: float = 1.0
    reduce: object = None

    def __call__(self, nbytes):
        p = self.workers
        if p <= 1 or nbytes <= 0:
            return 0.0
        wire = 2.0 * nbytes * (p - 1) / p * 8.0 / (self.bandwidth_bps * self.ratio)
        adds = (p - 1) * self.reduce(nbytes / p) if self.reduce is not None else 0.0
        return 2 * (p - 1) * self.latency_s + wire + adds

    def linear(self):
        """The same cost as a :class:`CostModel` (only without a reduction table)."""
        if self.reduce is not None:
            raise ValueError("a ring with a reduction table is not a line")
        p = self.workers
        if p <= 1:
            return CostModel(0.0, 0.0)
        return CostModel(2 * (p - 1) * self.latency_s, 2.0 * (p - 1) / p * 8.0 / (self.bandwidth_bps * self.ratio))
