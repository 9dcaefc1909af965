"""Time of one sparse allreduce from the engine's counted volume: a cost per message, per byte
sent and per byte received (each algorithm's own local work), fitted to timed exchanges, and
predictions to large P from the closed forms of :mod:`.volumes`.

One call of an exchange on P ranks is charged what its busiest rank does (the critical path:
the engine's collectives wait for the slowest rank, and every rank's link is its own):

    t = alpha M + beta max(0, B - burst) + c gamma_a R

with M the most messages any rank sends in the call, B the most bytes any rank sends, R the
most bytes any rank receives; gTop-k's tree levels run one after the other, so for it M and B
are the root's messages and bytes both ways (:func:`busiest`). alpha and beta = 8 / bandwidth
are :class:`.model.Network`'s ``latency_s`` and ``bandwidth_bps`` (the what-if model's link);
gamma_a is algorithm a's local work per byte received (adding for dense, merging the received
sparse vectors for the others: they differ by a factor of 100 per byte); c = max(1, P / cores)
is the oversubscription of the machine that was timed (1 where every rank has its own core);
``burst`` is the emulated link's token bucket (``tc tbf burst``, 256 KiB in scripts/netem.py:
that much leaves at the speed of the host, not of the link), 0 on a real link. :func:`fit`
and :func:`fit_links` find the costs by non-negative least squares on relative error from
timed records (``scripts/bench_exchange.py`` with recorded selections: each record holds every
rank's counters for each timed call); :func:`features` reads (M, B, R) from a record,
:func:`critical_volume` from the closed forms at any P.

It leaves out: the time a rank waits for a slower peer's local work (only the busiest rank's
counters enter), the selection of the top-k itself (the exchange starts from it), contention
inside a switch, any change of alpha or gamma with P other than the oversubscription (fitted
where P <= 8), and the sparse vectors' growth in the local work of TopkA beyond linear.

    >>> cost = ExchangeCost(Network(8e9, 1e-4))
    >>> round(cost.seconds(Features(messages=10, bytes_sent=1e6, bytes_received=0)), 6)
    0.002
"""
import math
from dataclasses import dataclass, field

import numpy as np

from horovod_sparse.whatif import volumes as vol
from horovod_sparse.whatif.model import Network

#: scripts/netem.py's ``tc tbf burst`` (256kb: KiB)
NETEM_BURST_BYTES = 256 * 1024


@dataclass(frozen=True)
class Features:
    """What sets one call's time: the busiest rank's messages sent, bytes sent, bytes received;
    the algorithm (its local work per byte) and the ranks per core where it ran (>= 1)."""

    messages: float
    bytes_sent: float
    bytes_received: float
    algorithm: str = "dense"
    oversubscription: float = 1.0


@dataclass(frozen=True)
class ExchangeCost:
    """A link (:class:`.model.Network`: bandwidth, and latency per message), each algorithm's
    local work per byte received (``local_s_per_byte``: {algorithm: seconds}), and the link's
    token-bucket burst (0: a real link)."""

    network: Network
    local_s_per_byte: dict = field(default_factory=dict)
    burst_bytes: float = 0.0

    @property
    def alpha_s(self):
        return self.network.latency_s

    @property
    def beta_s(self):
        """Seconds per byte sent."""
        return 8.0 / self.network.bandwidth_bps

    def seconds(self, f):
        wire = self.network.transfer(max(0.0, f.bytes_sent - self.burst_bytes), f.messages)
        return wire + f.oversubscription * self.local_s_per_byte.get(f.algorithm, 0.0) * f.bytes_received

    def on_link(self, gbps, latency_s=None):
        """The same local costs on a real (no burst) link of ``gbps`` Gbit/s (nominal rate), with
        this per-message cost or ``latency_s``."""
        lat = self.network.latency_s if latency_s is None else latency_s
        return ExchangeCost(Network.from_gbps(gbps, lat), dict(self.local_s_per_byte), 0.0)


# ------------------------------------------------------------------ from timed records
def busiest(algorithm, per_rank, oversubscription=1.0):
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
    return Features(float(m), float(b), float(max(br for _, _, br, _ in per_rank)), algorithm,
                    float(oversubscription))


def oversubscription(record, cores=None):
    """Ranks per core of a record's run: max(1, P / cores) (cores: the record's ``cpus``)."""
    cores = cores or record.get("cpus") or record["P"]
    return max(1.0, record["P"] / cores)


def features(record, call=None, cores=None):
    """:class:`Features` of a bench record (``per_call``: every rank's counters per timed
    call): per call :func:`busiest`, then the mean over the timed calls (or one ``call``)."""
    calls = record["per_call"] if call is None else [record["per_call"][call]]
    per = []
    for c in calls:
        received = c.get("messages_received", c["messages_sent"])
        per.append(busiest(record["algorithm"], list(zip(c["messages_sent"], c["bytes_sent"],
                                                         c["bytes_received"], received))))
    mean = [float(np.mean([getattr(f, x) for f in per])) for x in ("messages", "bytes_sent", "bytes_received")]
    return Features(*mean, record["algorithm"], oversubscription(record, cores))


def measured_seconds(record):
    """The record's time of one call: the median over the timed calls of the slowest rank."""
    return float(record["median_s"])


def fit_links(records_by_link, burst_bytes=0.0, cores=None):
    """One fit over one or more links (``{label: records}``): a bandwidth per link; the
    per-message cost and every algorithm's local work per byte received shared by all.
    Bytes sent and received are nearly equal in most exchanges, so one link alone hardly
    tells beta from gamma; links of different rates do (beta changes, gamma does not).
    Non-negative least squares on relative error. Returns ``{label: ExchangeCost}``."""
    from scipy.optimize import nnls
    labels = list(records_by_link)
    algs = sorted({r["algorithm"] for recs in records_by_link.values() for r in recs})
    rows, times = [], []
    for j, label in enumerate(labels):
        for rec in records_by_link[label]:
            f = features(rec, cores=cores)
            row = [0.0] * (1 + len(algs) + len(labels))
            row[0] = f.messages
            row[1 + algs.index(f.algorithm)] = f.oversubscription * f.bytes_received
            row[1 + len(algs) + j] = max(0.0, f.bytes_sent - burst_bytes)
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
    local = {a: float(coef[1 + i]) for i, a in enumerate(algs)}
    out = {}
    for j, label in enumerate(labels):
        beta = float(coef[1 + len(algs) + j])
        out[label] = ExchangeCost(Network(8.0 / beta if beta > 0 else math.inf, float(coef[0])), local,
                                  burst_bytes)
    return out


def fit(records, burst_bytes=0.0, cores=None):
    """:func:`fit_links` of one link's records: an :class:`ExchangeCost`."""
    return fit_links({"link": list(records)}, burst_bytes, cores)["link"]


def validation(records, cost, cores=None):
    """[(record, predicted s, measured s, relative error)] of ``cost`` on the records."""
    out = []
    for rec in records:
        p, m = cost.seconds(features(rec, cores=cores)), measured_seconds(rec)
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
        return min(vol.uniform_union(n, k, P), self.coefficient * k * P ** self.exponent)

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
        return Features(0.0, 0.0, 0.0, algorithm)
    kw = {}
    if algorithm in ("dsa", "oktopk"):
        kw["stats"] = _stats(n, k, P, overlap)
    if algorithm == "oktopk":
        repartition, exact = vol.oktopk_schedule(call)
        kw.update(repartition=repartition, exact=exact)
    per = [vol.volume(algorithm, n, k, P, r, **kw) for r in _ranks(algorithm, P)]
    return busiest(algorithm, [(v.messages_sent, v.bytes_sent, v.bytes_received, v.messages_received)
                               for v in per])


def predict_seconds(algorithm, n, k, P, cost, overlap=None, amortized=True):
    """Predicted seconds of one call. Ok-Topk, ``amortized``: the mean over its 64-call cycle
    (one repartitioning exact call, one more exact call, 62 later calls); else a later call."""
    if algorithm != "oktopk" or not amortized:
        return cost.seconds(critical_volume(algorithm, n, k, P, overlap))
    later = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=1))
    exact = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=vol.TAU_PRIME))
    first = cost.seconds(critical_volume(algorithm, n, k, P, overlap, call=0))
    n_exact = vol.TAU // vol.TAU_PRIME - 1
    return (first + n_exact * exact + (vol.TAU - 1 - n_exact) * later) / vol.TAU


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
#: timed-10gbit.jsonl, recorded step 30, burst 256 KiB, 2 cores (scripts/predict_scale.py
#: prints it): seconds per message and each algorithm's local seconds per byte received.
FITTED = {"alpha_s": 0.00014855804658958657,
          "local_s_per_byte": {"allgather": 5.4527439157006825e-09, "dense": 1.5516436514748287e-09,
                               "dsa": 5.324241209712038e-11, "gtopk": 2.283043451895305e-09, "oktopk": 0.0}}


def default_cost(gbps, latency_s=None):
    """The fitted per-message and local costs on a real ``gbps`` link (nominal rate): the
    what-if advice's costs (``latency_s`` replaces the fitted per-message cost)."""
    alpha = FITTED["alpha_s"] if latency_s is None else latency_s
    return ExchangeCost(Network.from_gbps(gbps, alpha), dict(FITTED["local_s_per_byte"]))


__all__ = ["Features", "ExchangeCost", "Overlap", "busiest", "features", "oversubscription", "NETEM_BURST_BYTES",
           "fit", "fit_links", "validation", "critical_volume", "predict_seconds", "sweep", "crossover",
           "lead_until", "fastest", "default_cost", "FITTED"]
