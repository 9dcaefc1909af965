"""Time of one sparse allreduce from the engine's counted volume: a cost per message, per byte
and per byte received, fitted to timed exchanges, and predictions to large P from the closed
forms of :mod:`.volumes`.

One call of an exchange on P ranks is charged what its busiest rank does (the critical path:
the engine's collectives wait for the slowest rank, and every rank's link is its own, so the
rank that sends the most bytes, or the most messages, sets the time):

    t = alpha * M + 8 B / bandwidth + gamma * R

with M the most messages any rank sends in the call, B the most bytes any rank sends, R the
most bytes any rank receives (the local work of adding, merging or copying what arrives,
charged per byte). gTop-k's tree levels run one after the other, so for it M and B are the
root's messages and bytes both ways (:func:`busiest`). alpha and bandwidth are :class:`.model.Network`'s ``latency_s`` and
``bandwidth_bps`` (the what-if model's link, one message = one latency), gamma is the local
work per byte received. :func:`fit` finds the three by non-negative least squares from timed
records (``scripts/bench_exchange.py`` with recorded selections: each record holds every
rank's counters for each timed call); :func:`features` reads (M, B, R) from a record,
:func:`critical_volume` from the closed forms at any P.

It leaves out: the time a rank waits for a slower peer's local work (only the busiest
rank's counters enter), the selection of the top-k itself (the exchange starts from it),
contention inside a switch (each link is its own), and any change of alpha with P (fitted
where P <= 8).

    >>> cost = ExchangeCost(Network(8e9, 1e-4), per_byte_received_s=0.0)
    >>> round(cost.seconds(Features(messages=10, bytes_sent=1e6, bytes_received=0)), 6)
    0.002
"""
import math
from dataclasses import dataclass

import numpy as np

from horovod_sparse.whatif import volumes as vol
from horovod_sparse.whatif.model import Network

#: Ok-Topk's defaults: repartition every ``TAU`` calls, exact threshold every ``TAU_PRIME``
TAU, TAU_PRIME = 64, 32


@dataclass(frozen=True)
class Features:
    """What sets one call's time: the busiest rank's messages sent, bytes sent, bytes received."""

    messages: float
    bytes_sent: float
    bytes_received: float


@dataclass(frozen=True)
class ExchangeCost:
    """A link (:class:`.model.Network`: bandwidth and latency per message) and the local work
    per byte received."""

    network: Network
    per_byte_received_s: float = 0.0

    @property
    def alpha_s(self):
        return self.network.latency_s

    @property
    def beta_s(self):
        """Seconds per byte sent."""
        return 8.0 / self.network.bandwidth_bps

    def seconds(self, f):
        return (self.network.transfer(f.bytes_sent, f.messages)
                + self.per_byte_received_s * f.bytes_received)

    def on_link(self, gbps):
        """The same per-message and local costs on a link of ``gbps`` Gbit/s (nominal rate)."""
        return ExchangeCost(Network.from_gbps(gbps, self.network.latency_s), self.per_byte_received_s)


# ------------------------------------------------------------------ from timed records
def busiest(algorithm, per_rank):
    """:class:`Features` of one call from ``per_rank`` (messages sent, bytes sent, bytes
    received, messages received) of every rank: the most over ranks of each. For gTop-k,
    whose tree levels run one after the other, the chain through the root is the critical
    path: each level's transfer is received, then (broadcast) sent, by the root in turn, so
    its messages and bytes both ways count (the most over ranks of sent + received)."""
    if algorithm == "gtopk":
        m = max(ms + mr for ms, _, _, mr in per_rank)
        b = max(bs + br for _, bs, br, _ in per_rank)
    else:
        m = max(ms for ms, _, _, _ in per_rank)
        b = max(bs for _, bs, _, _ in per_rank)
    return Features(float(m), float(b), float(max(br for _, _, br, _ in per_rank)))


def features(record, call=None):
    """:class:`Features` of a bench record (``per_call``: every rank's counters per timed
    call): per call :func:`busiest`, then the mean over the timed calls (or one ``call``)."""
    calls = record["per_call"] if call is None else [record["per_call"][call]]
    per = []
    for c in calls:
        received = c.get("messages_received", c["messages_sent"])
        per.append(busiest(record["algorithm"], list(zip(c["messages_sent"], c["bytes_sent"],
                                                         c["bytes_received"], received))))
    return Features(*(float(np.mean([getattr(f, x) for f in per])) for x in ("messages", "bytes_sent",
                                                                               "bytes_received")))


def measured_seconds(record):
    """The record's time of one call: the median over the timed calls of the slowest rank."""
    return float(record["median_s"])


def fit(records, local=True):
    """Non-negative least squares of :func:`measured_seconds` on (M, B, R) of the records
    (one link); relative errors are what is minimised (each row divided by its time), so that
    a 10 ms and a 1 s call count alike. ``local=False`` fits alpha and beta only. Returns an
    :class:`ExchangeCost`."""
    from scipy.optimize import nnls
    rows, times = [], []
    for rec in records:
        f = features(rec)
        rows.append([f.messages, f.bytes_sent] + ([f.bytes_received] if local else []))
        times.append(measured_seconds(rec))
    A, t = np.asarray(rows, float), np.asarray(times, float)
    if len(t) < A.shape[1]:
        raise ValueError(f"need at least {A.shape[1]} records to fit, got {len(t)}")
    w = 1.0 / t
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A * w[:, None] / scale, t * w)
    coef = coef / scale
    alpha, beta = float(coef[0]), float(coef[1])
    gamma = float(coef[2]) if local else 0.0
    bandwidth = 8.0 / beta if beta > 0 else math.inf
    return ExchangeCost(Network(bandwidth, alpha), gamma)


def fit_links(records_by_link, per_link_alpha=False):
    """One fit over several links (``{label: records}``): a bandwidth per link, and the
    per-message cost (unless ``per_link_alpha``) and the local work per byte received shared
    by all. Bytes sent and received are nearly equal in most exchanges, so one link alone
    hardly tells beta from gamma; links of different rates do (beta changes, gamma does not).
    Non-negative least squares on relative error. Returns ``{label: ExchangeCost}``."""
    from scipy.optimize import nnls
    labels = list(records_by_link)
    L = len(labels)
    n_alpha = L if per_link_alpha else 1
    rows, times = [], []
    for j, label in enumerate(labels):
        for rec in records_by_link[label]:
            f = features(rec)
            row = [0.0] * (n_alpha + 1 + L)
            row[j if per_link_alpha else 0] = f.messages
            row[n_alpha] = f.bytes_received
            row[n_alpha + 1 + j] = f.bytes_sent
            rows.append(row)
            times.append(measured_seconds(rec))
    A, t = np.asarray(rows, float), np.asarray(times, float)
    if len(t) < A.shape[1]:
        raise ValueError(f"need at least {A.shape[1]} records to fit, got {len(t)}")
    w = 1.0 / t
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A * w[:, None] / scale, t * w)
    coef = coef / scale
    out = {}
    for j, label in enumerate(labels):
        beta = float(coef[n_alpha + 1 + j])
        alpha = float(coef[j if per_link_alpha else 0])
        out[label] = ExchangeCost(Network(8.0 / beta if beta > 0 else math.inf, alpha), float(coef[n_alpha]))
    return out


def validation(records, cost):
    """[(record, predicted s, measured s, relative error)] of ``cost`` on the records."""
    out = []
    for rec in records:
        p, m = cost.seconds(features(rec)), measured_seconds(rec)
        out.append((rec, p, m, p / m - 1.0))
    return out


# ------------------------------------------------------------------ closed forms at any P
@dataclass(frozen=True)
class Overlap:
    """The union of the P ranks' selections as ``coefficient * k * P**exponent`` (capped by
    the uniform union and by n): the measured overlap trend of real selections. ``None``
    in its place means the uniform bound (independent selections, the largest union)."""

    coefficient: float
    exponent: float

    def union(self, n, k, P):
        uniform = n * (1.0 - (1.0 - min(1.0, k / n)) ** P)
        return min(uniform, self.coefficient * k * P ** self.exponent)

    @classmethod
    def fitted(cls, unions, k):
        """From measured ``{P: union}``: least squares of log(union / k) on log P."""
        Ps = sorted(unions)
        x, y = np.log(Ps), np.log([unions[p] / k for p in Ps])
        e, c = np.polyfit(x, y, 1)
        return cls(float(math.exp(c)), float(e))


def _stats(n, k, P, overlap):
    stats = vol.uniform_stats(n, k, P)
    if overlap is None:
        return stats
    per_region = overlap.union(n, k, P) / P
    return vol.RegionStats(own=stats.own, out_peers=stats.out_peers, in_peers=stats.in_peers,
                           incoming=stats.incoming, union=(per_region,) * P, length=stats.length,
                           counts=stats.counts)


def _ranks(algorithm, P):
    """The ranks whose counters can differ from rank 0's under the uniform model."""
    if algorithm == "gtopk" or P <= 16:
        return range(P)
    return sorted({0, 1, P // 2, P - 1})


def critical_volume(algorithm, n, k, P, overlap=None, call=1):
    """:class:`Features` of one call from the closed forms (the uniform model, or ``overlap``
    for the union of the selections): the most over ranks. Ok-Topk's ``call`` number decides
    whether it repartitions and computes the exact threshold (call 1: neither)."""
    if P <= 1:
        return Features(0.0, 0.0, 0.0)
    kw = {}
    if algorithm in ("dsa", "oktopk"):
        kw["stats"] = _stats(n, k, P, overlap)
    if algorithm == "oktopk":
        kw.update(repartition=call % TAU == 0, exact=call % TAU_PRIME == 0)
    per = [vol.volume(algorithm, n, k, P, r, **kw) for r in _ranks(algorithm, P)]
    return busiest(algorithm, [(v.messages_sent, v.bytes_sent, v.bytes_received, v.messages_received)
                               for v in per])


def predict_seconds(algorithm, n, k, P, cost, overlap=None, amortized=True):
    """Predicted seconds of one call. Ok-Topk, ``amortized``: the mean over its 64-call cycle
    (one repartitioning exact call, one more exact call, 62 later calls); else a later call."""
    if algorithm != "oktopk" or not amortized:
        return cost.seconds(critical_volume(algorithm, n, k, P, overlap))
    later = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=1))
    exact = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=TAU_PRIME))
    first = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=0))
    calls = TAU
    n_exact = TAU // TAU_PRIME - 1
    return (first + n_exact * exact + (calls - 1 - n_exact) * later) / calls


def sweep(n, k, Ps, cost, algorithms=vol.ALGORITHMS, overlap=None):
    """``{algorithm: [seconds per P]}``."""
    return {a: [predict_seconds(a, n, k, P, cost, overlap) for P in Ps] for a in algorithms}


def crossover(times, Ps, fast="oktopk", slow="allgather"):
    """The smallest P of ``Ps`` from which ``fast`` is faster than ``slow`` at every larger P
    of the sweep (``times``: :func:`sweep`'s), None when it is not faster at the largest."""
    a, b = times[fast], times[slow]
    found = None
    for i in range(len(Ps) - 1, -1, -1):
        if a[i] < b[i]:
            found = Ps[i]
        else:
            break
    return found


def lead_until(times, Ps, fast="oktopk", slow="allgather"):
    """The largest P of ``Ps`` up to which ``fast`` is faster than ``slow`` at every smaller P
    of the sweep, None when it is not faster at the smallest."""
    found = None
    for i, P in enumerate(Ps):
        if times[fast][i] < times[slow][i]:
            found = P
        else:
            break
    return found


def fastest(n, k, P, cost, algorithms=vol.ALGORITHMS, overlap=None):
    """``(algorithm, {algorithm: seconds})``: the one predicted fastest at P."""
    times = {a: predict_seconds(a, n, k, P, cost, overlap) for a in algorithms}
    return min(times, key=times.get), times


# ------------------------------------------------------------------ the fitted costs
#: The joint fit (:func:`fit_links`) of docs/results/data/oktopk-scale/timed-1gbit.jsonl and
#: timed-10gbit.jsonl, recorded step 30 (scripts/predict_scale.py prints it): per message and
#: per byte received; ``bandwidth_bps``: what the emulated 10 Gbit/s link gave (the predictions
#: use the nominal rate).
FITTED = {"alpha_s": 6e-05, "per_byte_received_s": 5e-10, "bandwidth_bps": 5e9}


def default_cost(gbps):
    """The fitted per-message and local costs on a nominal ``gbps`` link (the what-if advice)."""
    return ExchangeCost(Network.from_gbps(gbps, FITTED["alpha_s"]),
                        FITTED["per_byte_received_s"])


__all__ = ["Features", "ExchangeCost", "Overlap", "busiest", "features", "fit", "fit_links", "validation", "critical_volume",
           "predict_seconds", "sweep", "crossover", "lead_until", "fastest", "default_cost", "FITTED"]
