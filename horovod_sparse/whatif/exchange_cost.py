"""Time of one sparse allreduce from the engine's counted volume: a cost per call, per message,
per byte sent and per byte received (each algorithm's own local work), fitted to timed
exchanges, and predictions to large P from the closed forms of :mod:`.volumes`.

One call of an exchange on P ranks is charged what its busiest rank does (the critical path:
the engine's collectives wait for the slowest rank, and every rank's link is its own):

    t = t_a + (alpha + w (c - 1)) M + beta W + c (gamma_a R + kappa_a k),    W = max(0, B - burst)

with M the most messages any rank sends in the call, B the most bytes any rank sends, R the
most bytes any rank receives, k the entries each rank selected (the exchange's input). gTop-k's
tree levels run one after the other, so for it M is the root's messages both ways, and W adds
to the root's own sends the transfers it receives in turn, each leaving its sender's link:
``chain_messages`` x max(0, their mean size - burst) (:func:`busiest`). t_a is algorithm a's
fixed work per call (its header, checks, rounds and result, whatever the volume: Ok-Topk's and
TopkDSA's phases cost more than TopkA's one allgather); alpha and beta = 8 / bandwidth are
:class:`.model.Network`'s ``latency_s`` and ``bandwidth_bps`` (the what-if model's link);
gamma_a is algorithm a's local work per byte received (adding for dense, merging the received
sparse vectors for the others: they differ by a factor of 100 per byte) and kappa_a its work per
entry of its own selection (sorting, splitting and packing it; none for dense, which densifies
n); c = max(1, P / cores) is the oversubscription of the machine that was timed (1 where every
rank has its own core), and w what each message adds per other rank on its receiver's core (the
receiver waits its turn to run; nothing where every rank has its own core); ``burst`` is the
emulated link's token bucket (``tc tbf burst``, 256 KiB in scripts/netem.py: that much leaves a
sender at the speed of the host, not of the link, once per sender and call), 0 on a real link. :func:`fit` and
:func:`fit_links` find the costs by non-negative least squares on relative error from timed
records (``scripts/bench_exchange.py``: each record holds every rank's counters for each timed
call), with beta the link's nominal rate where it is known and alpha measured apart where given
(a ping-pong: timed calls hardly tell a message from the work around it); :func:`features`
reads (M, B, R, k) from a record, :func:`critical_volume` from the closed forms at any P.

It leaves out: the time a rank waits for a slower peer's local work (only the busiest rank's
counters enter), the selection of the top-k itself (the exchange starts from it), contention
inside a switch, how MPI's collectives forward blocks from rank to rank (a collective is counted
as the direct exchange), the cache (a byte costs the same whatever the arrays' size), any change
of alpha or gamma with P other than the oversubscription (fitted where P <= 8), and the sparse
vectors' growth in the local work of TopkA beyond linear.

    >>> cost = ExchangeCost(Network(8e9, 1e-4), call_s={"dense": 1e-3})
    >>> round(cost.seconds(Features(messages=10, bytes_sent=1e6, bytes_received=0)), 6)
    0.003
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
    the algorithm (its local work per byte) and the ranks per core where it ran (>= 1); for a
    chain (gTop-k's root), the transfers it receives in turn, each from its own sender's link:
    how many and their bytes (their messages are already in ``messages``)."""

    messages: float
    bytes_sent: float
    bytes_received: float
    algorithm: str = "dense"
    oversubscription: float = 1.0
    chain_messages: float = 0.0
    chain_bytes: float = 0.0
    selected: float = 0.0

    def wire_bytes(self, burst=0.0):
        """Bytes on the critical path that leave at the link's rate: each sender's beyond its
        ``burst`` (the busiest rank's own sends; a chain's transfers, one sender each)."""
        own = max(0.0, self.bytes_sent - burst)
        if self.chain_messages <= 0:
            return own
        return own + self.chain_messages * max(0.0, self.chain_bytes / self.chain_messages - burst)


@dataclass(frozen=True)
class ExchangeCost:
    """A link (:class:`.model.Network`: bandwidth, and latency per message), each algorithm's
    local work per byte received and per entry selected (``local_s_per_byte``,
    ``local_s_per_selected``: {algorithm: seconds}), the link's token-bucket burst (0: a real
    link), each algorithm's fixed seconds per call (``call_s``: {algorithm: seconds}) and the
    seconds a message waits per other rank on its receiver's core (``wakeup_s``)."""

    network: Network
    local_s_per_byte: dict = field(default_factory=dict)
    burst_bytes: float = 0.0
    call_s: dict = field(default_factory=dict)
    local_s_per_selected: dict = field(default_factory=dict)
    wakeup_s: float = 0.0

    @property
    def alpha_s(self):
        return self.network.latency_s

    @property
    def beta_s(self):
        """Seconds per byte sent."""
        return 8.0 / self.network.bandwidth_bps

    def seconds(self, f):
        wire = self.network.transfer(f.wire_bytes(self.burst_bytes), f.messages)
        local = (self.local_s_per_byte.get(f.algorithm, 0.0) * f.bytes_received
                 + self.local_s_per_selected.get(f.algorithm, 0.0) * f.selected)
        waits = self.wakeup_s * (f.oversubscription - 1.0) * f.messages
        return self.call_s.get(f.algorithm, 0.0) + wire + waits + f.oversubscription * local

    def on_link(self, gbps, latency_s=None):
        """The same local costs on a real (no burst) link of ``gbps`` Gbit/s (nominal rate), with
        this per-message cost or ``latency_s``."""
        lat = self.network.latency_s if latency_s is None else latency_s
        return ExchangeCost(Network.from_gbps(gbps, lat), dict(self.local_s_per_byte), 0.0, dict(self.call_s),
                            dict(self.local_s_per_selected), self.wakeup_s)


# ------------------------------------------------------------------ from timed records
def busiest(algorithm, per_rank, oversubscription=1.0, selected=0.0):
    """:class:`Features` of one call from ``per_rank`` (messages sent, bytes sent, bytes
    received, messages received) of every rank: the most over ranks of each. For gTop-k,
    whose tree levels run one after the other, the chain through the root is the critical
    path: each level's transfer is received, then (broadcast) sent, by the root in turn, so
    the root's (the rank that moves the most bytes both ways) messages both ways count, its
    own sends as ``bytes_sent`` and what it receives as the chain. ``selected``: the entries
    each rank put in (k), kept as 0 for dense, whose work does not depend on it."""
    received = float(max(br for _, _, br, _ in per_rank))
    selected = 0.0 if algorithm == "dense" else float(selected)
    if algorithm == "gtopk":
        ms, bs, br, mr = max(per_rank, key=lambda r: (r[1] + r[2], r[0] + r[3]))
        return Features(float(ms + mr), float(bs), received, algorithm, float(oversubscription),
                        float(mr), float(br), float(selected))
    return Features(float(max(ms for ms, _, _, _ in per_rank)), float(max(bs for _, bs, _, _ in per_rank)),
                    received, algorithm, float(oversubscription), selected=float(selected))


def oversubscription(record, cores=None):
    """Ranks per core of a record's run: max(1, P / cores) (cores: the record's ``cpus``)."""
    cores = cores or record.get("cpus") or record["P"]
    return max(1.0, record["P"] / cores)


def features(record, call=None, cores=None):
    """:class:`Features` of a bench record (``per_call``: every rank's counters per timed
    call; ``k``: the entries each rank selected): per call :func:`busiest`, then the mean over
    the timed calls (or one ``call``)."""
    calls = record["per_call"] if call is None else [record["per_call"][call]]
    per = []
    for c in calls:
        received = c.get("messages_received", c["messages_sent"])
        per.append(busiest(record["algorithm"], list(zip(c["messages_sent"], c["bytes_sent"],
                                                         c["bytes_received"], received)),
                           selected=record.get("k", 0)))
    mean = {x: float(np.mean([getattr(f, x) for f in per]))
            for x in ("messages", "bytes_sent", "bytes_received", "chain_messages", "chain_bytes")}
    return Features(algorithm=record["algorithm"], oversubscription=oversubscription(record, cores),
                    selected=per[0].selected if per else 0.0, **mean)


def measured_seconds(record):
    """The record's time of one call: the median over the timed calls of the slowest rank."""
    return float(record["median_s"])


def pool_rounds(records):
    """One record per measured case (link, algorithm, P, inputs, first timed call) of records
    timed in several rounds: the calls of all rounds pooled (``times_s``, their median, min and
    max; ``round_medians_s``: each round's own ``median_s``), the counters of the first (a case's
    counts are the same in every round). Why: on a shared 2-core VM one run's median of a few
    calls of a few milliseconds moves by up to 2x from one run to the next (10% at the median
    case), so one run cannot check a model to 20%.

        >>> r = dict(rate="1gbit", algorithm="dense", P=2, n=8, k=8, times_s=[1.0, 3.0], median_s=2.0, per_call=[])
        >>> [(p["round_medians_s"], p["median_s"]) for p in pool_rounds([r, dict(r, times_s=[2.5], median_s=2.5)])]
        [([2.0, 2.5], 2.5)]
    """
    pooled = {}
    for r in records:
        case = (r["rate"], r["algorithm"], r["P"], r["n"], r["k"], r.get("selections_step"),
                r.get("inputs"), r.get("first_call"))
        if case in pooled:
            pooled[case]["times_s"] += r["times_s"]
            pooled[case]["round_medians_s"].append(r["median_s"])
        else:
            pooled[case] = dict(r, times_s=list(r["times_s"]), round_medians_s=[r["median_s"]])
    for p in pooled.values():
        p.update(median_s=float(np.median(p["times_s"])), min_s=min(p["times_s"]), max_s=max(p["times_s"]))
    return list(pooled.values())


def fit_links(records_by_link, burst_bytes=0.0, cores=None, bandwidth_bps=None, latency_s=None):
    """One fit over one or more links (``{label: records}``): every algorithm's cost per call and
    local work per byte received and per entry selected, and the wait of a message per other rank
    on a core, shared by all; the per-message cost, fitted, or ``latency_s`` (measured apart);
    and a bandwidth per link,
    fitted, or the link's nominal rate from ``bandwidth_bps`` (``{label: bits per second}``; a
    fitted one absorbs whatever the other terms miss, so that a prediction on a nominal link
    would charge it twice). Non-negative least squares on relative error. Returns
    ``{label: ExchangeCost}``."""
    from scipy.optimize import nnls
    labels = list(records_by_link)
    fixed = dict(bandwidth_bps or {})
    free = [label for label in labels if label not in fixed]
    algs = sorted({r["algorithm"] for recs in records_by_link.values() for r in recs})
    sparse = [a for a in algs if a != "dense"]
    columns = ([("call", a) for a in algs] + ["message", "wakeup"] + [("byte", a) for a in algs]
               + [("selected", a) for a in sparse] + free)
    rows, times, known = [], [], []
    for label in labels:
        for rec in records_by_link[label]:
            f = features(rec, cores=cores)
            row = dict.fromkeys(columns, 0.0)
            row["call", f.algorithm] = 1.0
            row["wakeup"] = (f.oversubscription - 1.0) * f.messages
            row["byte", f.algorithm] = f.oversubscription * f.bytes_received
            if f.algorithm in sparse:
                row["selected", f.algorithm] = f.oversubscription * f.selected
            wire, extra = f.wire_bytes(burst_bytes), 0.0
            if label in fixed:
                extra += wire * 8.0 / fixed[label]
            else:
                row[label] = wire
            if latency_s is None:
                row["message"] = f.messages
            else:
                extra += latency_s * f.messages
            rows.append([row[c] for c in columns])
            times.append(measured_seconds(rec))
            known.append(extra)
    A, t, known = np.asarray(rows, float), np.asarray(times, float), np.asarray(known, float)
    used = A.any(axis=0)
    if len(t) < used.sum():
        raise ValueError(f"need at least {used.sum()} records to fit, got {len(t)}")
    w = 1.0 / t
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A * w[:, None] / scale, (t - known) * w)
    coef = dict(zip(columns, coef / scale))
    alpha = float(coef["message"]) if latency_s is None else float(latency_s)
    per_byte = {a: float(coef["byte", a]) for a in algs}
    per_selected = {a: float(coef["selected", a]) for a in sparse}
    per_call = {a: float(coef["call", a]) for a in algs}
    out = {}
    for label in labels:
        if label in fixed:
            bps = float(fixed[label])
        else:
            bps = 8.0 / coef[label] if coef[label] > 0 else math.inf
        out[label] = ExchangeCost(Network(bps, alpha), per_byte, burst_bytes, per_call, per_selected,
                                  float(coef["wakeup"]))
    return out


def fit(records, burst_bytes=0.0, cores=None, bandwidth_bps=None, latency_s=None):
    """:func:`fit_links` of one link's records (``bandwidth_bps``: its nominal rate, else
    fitted): an :class:`ExchangeCost`."""
    fixed = None if bandwidth_bps is None else {"link": bandwidth_bps}
    return fit_links({"link": list(records)}, burst_bytes, cores, fixed, latency_s)["link"]


def validation(records, cost, cores=None):
    """[(record, predicted s, measured s, relative error)] of ``cost`` on the records."""
    out = []
    for rec in records:
        p, m = cost.seconds(features(rec, cores=cores)), measured_seconds(rec)
        out.append((rec, p, m, p / m - 1.0))
    return out


# ------------------------------------------------------------------ closed forms at any P
def selection_unions(selections):
    """``{P: distinct indices among the first P rows}`` of ``selections`` (one rank's selected
    indices per row) for P = 2, 4, ... up to the rows: how much real ranks' selections overlap
    (P independent uniform ones would hold the most); what :meth:`Overlap.fitted` takes.

    >>> selection_unions(np.array([[0, 1], [1, 2], [2, 3], [3, 4]]))
    {2: 3, 4: 5}
    """
    out, P = {}, 2
    while P <= selections.shape[0]:
        out[P] = int(np.unique(np.asarray(selections[:P], np.int64)).size)
        P *= 2
    return out


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
                               for v in per], selected=k)


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
#: The joint fit (:func:`fit_links`) of docs/results/data/oktopk-scale/timed-{1,10}gbit.jsonl
#: (recorded step 30) and timed-uniform-{1,10}gbit.jsonl, burst 256 KiB, the links at their
#: nominal rates, alpha measured by ping-pong (pingpong.jsonl), 2 cores (scripts/predict_scale.py
#: prints it): each algorithm's seconds per call, the seconds per message (and its wait per other
#: rank on a core, which no prediction uses: one rank per core), and each algorithm's local
#: seconds per byte received and per entry selected.
FITTED = {"call_s": {"allgather": 0.00014564462947310732, "dense": 0.0, "dsa": 0.0005329031673436898,
                     "gtopk": 0.0, "oktopk": 0.0003353768231470842},
          "alpha_s": 6.434396498661954e-06, "wakeup_s": 3.2947788009190133e-06,
          "local_s_per_byte": {"allgather": 3.5597737940316396e-09, "dense": 9.384754262061553e-10,
                               "dsa": 1.3193774901455849e-09, "gtopk": 1.0440968668440463e-09,
                               "oktopk": 4.471073105382957e-09},
          "local_s_per_selected": {"allgather": 2.4161229721196573e-09, "dsa": 1.0892278197759792e-08,
                                   "gtopk": 8.649868028275524e-08, "oktopk": 0.0}}


def default_cost(gbps, latency_s=None):
    """The fitted per-call, per-message and local costs on a real ``gbps`` link (nominal rate):
    the what-if advice's costs (``latency_s`` replaces the measured per-message cost)."""
    alpha = FITTED["alpha_s"] if latency_s is None else latency_s
    return ExchangeCost(Network.from_gbps(gbps, alpha), dict(FITTED["local_s_per_byte"]), 0.0, dict(FITTED["call_s"]),
                        dict(FITTED["local_s_per_selected"]), FITTED["wakeup_s"])


__all__ = ["Features", "ExchangeCost", "Overlap", "selection_unions", "busiest", "features", "oversubscription", "NETEM_BURST_BYTES",
           "fit", "fit_links", "pool_rounds", "validation", "critical_volume", "predict_seconds", "sweep", "crossover",
           "lead_until", "fastest", "default_cost", "FITTED"]
