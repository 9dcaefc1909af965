"""Closed forms of what the exchange engine's counters count, per rank and call.

:mod:`.wire` predicts a step's bytes from a compressor's parameters with the payload terms
only; this module gives the engine's own count, term by term, in the units of
:class:`horovod_sparse.exchange.comm.Traffic`: bytes (indices of ``index_bytes``, 4 below
2**31 elements, values of ``value_bytes``, control data as int64) and messages, each way,
with the counting model of :mod:`horovod_sparse.exchange.comm` (a collective counts as the
direct exchange, an allreduce as a ring). Every call starts with the agreement header
(:data:`HEADER_FIELDS` int64 allgathered: 80(P-1) bytes, P-1 messages each way).

Per rank and call (ib + vb = 8 bytes a pair; header and control terms in the functions):

* ``dense``: 2(n - n_r) vb in 2(P-1) messages, n_r = this rank's ring chunk (mean 2n(P-1)/P vb);
* ``allgather`` (TopkA): c_r (P-1) pairs sent, the others' counts received, P-1 messages;
* ``gtopk``: one sparse send up the reduction tree (a count, k indices, k values: 3 messages),
  one send of s values (the exact sums) and, per child in the broadcast tree, the length,
  s indices and s values; s = min(k, union). The mean over ranks is (P-1)/P of one of each;
  for a power of two rank 1 sends the most, log2 P (8 + 8s) + 8k - 4s (s = k: :mod:`.wire`'s
  log2 P 8k + 4k plus the 8-byte lengths);
* ``dsa``: its k - o_r entries outside its own region to their owners, then its region to the
  P-1 others, as u_r pairs or, when that is larger, L_r dense values (u_r = the union of the
  ranks' entries inside the region, L_r its length), plus the count exchange and the layout;
* ``oktopk``: the same first phase over the repartitioned regions, then the balancing moves
  (entries of a region's selection that belong to another rank's equal share; none when the
  regions select equal counts) and the Allgatherv of the equal shares, K/P pairs each
  (K = the entries selected, k at an exact threshold); the first call (and every ``tau``-th)
  repartitions (a ring allreduce of P int64), an exact threshold (first call, every
  ``tau_prime``-th) adds a radix select (4 ring allreduces of 256 int64) or a gather of the
  candidates, whichever is smaller, and three small allgathers.

Without data, ``stats=None`` assumes what a uniform random input gives on average: o_r = k/P,
every rank sending to every other, a union of n(1 - (1 - k/n)^P), equal selections per region.
:func:`data_stats` measures the same quantities from the ranks' actual selections, and with
them the forms are exact (tested against the counters in tests/parallel/scale).

    >>> v = volume("allgather", n=1_000_000, k=10_000, P=4)
    >>> v.bytes_sent == 3 * 8 * 10_000 + 3 * 80, v.messages_sent
    (True, 6.0)
    >>> round(volume("oktopk", 1_000_000, 10_000, 4).bytes_sent / (2 * 3 / 4 * 8 * 10_000), 3)
    1.003
"""
import math
from dataclasses import dataclass, fields

import numpy as np

#: int64 fields of the agreement header (horovod_sparse.exchange.validation.HEADER_FIELDS)
HEADER_FIELDS = 10
#: Ok-Topk's radix select: 256 int64 counts per pass, one pass per key byte (float32: 4)
_BUCKETS, _RADIX_PASSES = 256, 4
#: Ok-Topk's defaults (horovod_sparse.exchange.oktopk.DEFAULTS): repartition every ``TAU``
#: calls, compute the exact threshold every ``TAU_PRIME``
TAU, TAU_PRIME = 64, 32
#: the five exchanges, in the order the tables give them
ALGORITHMS = ("dense", "allgather", "gtopk", "dsa", "oktopk")
#: the algorithms by name, as the tables and the paper say them
LABELS = {"dense": "dense (ring)", "allgather": "TopkA", "gtopk": "gTop-k", "dsa": "TopkDSA", "oktopk": "Ok-Topk"}


@dataclass(frozen=True)
class Volume:
    """Bytes and messages of one call on one rank (or the mean over ranks), each way."""

    bytes_sent: float = 0.0
    bytes_received: float = 0.0
    messages_sent: float = 0.0
    messages_received: float = 0.0

    def __add__(self, other):
        return Volume(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, factor):
        return Volume(*(getattr(self, f.name) * factor for f in fields(self)))


def _both(nbytes, messages):
    return Volume(nbytes, nbytes, messages, messages)


def index_bytes(n):
    """The engine's wire index size: int32 below 2**31 elements, else int64."""
    return 4 if n < 2 ** 31 else 8


def header(P):
    """The agreement header every call starts with: an Allgather of 10 int64."""
    return _both(8 * HEADER_FIELDS * (P - 1), P - 1) if P > 1 else Volume()


def _ring_chunk(elements, P, rank):
    return ((rank + 1) * elements) // P - (rank * elements) // P


def _ring_allreduce(elements, item, P, rank=None):
    """The comm's ring model: 2 (elements - own chunk) items each way in 2(P-1) messages."""
    if P <= 1:
        return Volume()
    own = elements / P if rank is None else _ring_chunk(elements, P, rank)
    return _both(2 * (elements - own) * item, 2 * (P - 1))


def _mean(per_rank, P):
    total = Volume()
    for r in range(P):
        total = total + per_rank(r)
    return total.scaled(1.0 / P)


# ------------------------------------------------------------------ the five exchanges
def dense(n, P, rank=None, value_bytes=4):
    """Ring allreduce of the n-value dense vector (mean: 2n(P-1)/P values each way)."""
    return header(P) + _ring_allreduce(n, value_bytes, P, rank)


def allgather(k, P, rank=None, counts=None, n=0, value_bytes=4):
    """TopkA: this rank's c_r pairs to each of the P-1 others, theirs back (counts: per rank)."""
    if P <= 1:
        return Volume()
    counts = [k] * P if counts is None else list(counts)
    pair = index_bytes(n) + value_bytes
    if rank is None:
        return _mean(lambda r: allgather(k, P, r, counts, n, value_bytes), P)
    sent = counts[rank] * pair * (P - 1)
    received = (sum(counts) - counts[rank]) * pair
    return header(P) + Volume(sent, received, P - 1, P - 1)


def _reduce_tree(P, rank):
    """(sends, receives) of ``rank`` in :func:`horovod_sparse.exchange.tree.reduce_to_root`."""
    power = 1 << (P.bit_length() - 1)
    if rank >= power:
        return 1, 0
    receives = 1 if rank + power < P else 0
    distance = 1
    while distance < power:
        if rank % (2 * distance) == distance:
            return 1, receives
        receives += 1
        distance *= 2
    return 0, receives


def _broadcast_children(P, rank):
    step = 1 << rank.bit_length() if rank else 1
    children = 0
    while rank + step < P:
        children += 1
        step *= 2
    return children


def gtopk(k, P, rank=None, selected=None, n=0, value_bytes=4):
    """gTop-k: tree reduce of top-k sparse vectors, broadcast of the s selected indices, tree
    reduce and broadcast of their s exact sums (``selected``: s, default k; every rank is
    assumed to hold at least k entries, so each sparse send carries k)."""
    if P <= 1:
        return Volume()
    if rank is None:
        return _mean(lambda r: gtopk(k, P, r, selected, n, value_bytes), P)
    s = k if selected is None else selected
    ib, vb = index_bytes(n), value_bytes
    up, from_children = _reduce_tree(P, rank)
    down = _broadcast_children(P, rank)
    has_parent = 1 if rank else 0
    sparse_up = 8 + k * (ib + vb) + s * vb       # count, indices, values; then the exact sums
    broadcast = 8 + s * (ib + vb)                 # length, indices, values
    return header(P) + Volume(up * sparse_up + down * broadcast,
                              from_children * sparse_up + has_parent * broadcast,
                              up * 4 + down * 3, from_children * 4 + has_parent * 3)


@dataclass(frozen=True)
class RegionStats:
    """What the data decide, per region r (= rank r): ``own[r]`` entries of rank r inside
    region r; ``out_peers[r]`` / ``in_peers[r]`` ranks it sends entries to / gets entries from;
    ``incoming[r]`` entries the others send into region r; ``union[r]`` distinct indices in
    region r; ``length[r]`` its width; ``counts[r]`` entries rank r holds (k each here)."""

    own: tuple
    out_peers: tuple
    in_peers: tuple
    incoming: tuple
    union: tuple
    length: tuple
    counts: tuple


def oktopk_schedule(call):
    """``(repartition, exact threshold)`` of Ok-Topk's call number ``call`` at its defaults (an
    input that changes between calls may also force an exact threshold)."""
    return call % TAU == 0, call % TAU_PRIME == 0


def uniform_union(n, k, P):
    """Distinct indices in P independent uniform selections of k of n, on average."""
    return n * (1.0 - (1.0 - min(1.0, k / n)) ** P) if n else 0.0


def equal_parts(k, P):
    """k entries in P equal parts (the first parts one smaller where k is not a multiple)."""
    return [(q + 1) * k // P - q * k // P for q in range(P)]


def uniform_stats(n, k, P):
    """The stats a uniform random input has on average (equal regions, independent ranks)."""
    union = uniform_union(n, k, P) / P
    return RegionStats(own=(k / P,) * P, out_peers=(P - 1,) * P, in_peers=(P - 1,) * P,
                       incoming=(k * (P - 1) / P,) * P, union=(union,) * P,
                       length=(n / P,) * P, counts=(k,) * P)


def data_stats(selections, bounds):
    """:class:`RegionStats` of the ranks' sorted index arrays ``selections`` over ``bounds``."""
    P = len(selections)
    bounds = np.asarray(bounds, dtype=np.int64)
    split = np.array([np.diff(np.searchsorted(np.asarray(s), bounds)) for s in selections])  # [rank, region]
    own = tuple(int(split[r, r]) for r in range(P))
    nonzero = split > 0
    np.fill_diagonal(nonzero, False)
    everything = np.unique(np.concatenate([np.asarray(s, dtype=np.int64) for s in selections]))
    union = tuple(int(c) for c in np.diff(np.searchsorted(everything, bounds)))
    return RegionStats(own=own, out_peers=tuple(int(c) for c in nonzero.sum(axis=1)),
                       in_peers=tuple(int(c) for c in nonzero.sum(axis=0)),
                       incoming=tuple(int(split[:, r].sum() - split[r, r]) for r in range(P)),
                       union=union, length=tuple(int(c) for c in np.diff(bounds)),
                       counts=tuple(int(split[r].sum()) for r in range(P)))


def _split_and_reduce(stats, P, rank, pair):
    """Phase 1 (Ok-Topk, TopkDSA): counts by Alltoall, entries outside the own region out."""
    counts = _both(8 * (P - 1), P - 1)
    out = (stats.counts[rank] - stats.own[rank]) * pair
    return counts + Volume(out, stats.incoming[rank] * pair,
                           2 * stats.out_peers[rank], 2 * stats.in_peers[rank])


def dsa(n, k, P, rank=None, stats=None, value_bytes=4):
    """TopkDSA: reduce at the static region owners, then each region to the P-1 others, sparse
    or dense, whichever is smaller (``stats``: :func:`data_stats` over equal regions, or the
    uniform model)."""
    if P <= 1:
        return Volume()
    stats = uniform_stats(n, k, P) if stats is None else stats
    if rank is None:
        return _mean(lambda r: dsa(n, k, P, r, stats, value_bytes), P)
    ib, vb = index_bytes(n), value_bytes

    def region_bytes(j):
        return min(stats.union[j] * (ib + vb), stats.length[j] * vb)   # dense once larger

    layout = _both(16 * (P - 1), P - 1)
    gathered = Volume(region_bytes(rank) * (P - 1), sum(region_bytes(j) for j in range(P)) - region_bytes(rank),
                      2 * (P - 1), 2 * (P - 1))
    return header(P) + _split_and_reduce(stats, P, rank, ib + vb) + layout + gathered


def balance(selected_per_region, P, rank, pair):
    """Ok-Topk phase 2: moves to equal shares (point-to-point), then the shares' Allgatherv."""
    K = [int(c) for c in selected_per_region]
    total = sum(K)
    held = np.concatenate(([0], np.cumsum(K)))
    target = [(q * total) // P for q in range(P + 1)]

    def overlap(holder, owner):
        return max(0, min(held[holder + 1], target[owner + 1]) - max(held[holder], target[owner]))

    out = [overlap(rank, q) for q in range(P) if q != rank]
    into = [overlap(h, rank) for h in range(P) if h != rank]
    share = target[rank + 1] - target[rank]
    moves = Volume(sum(out) * pair, sum(into) * pair, 2 * sum(1 for c in out if c), 2 * sum(1 for c in into if c))
    return moves + Volume(share * pair * (P - 1), (total - share) * pair, P - 1, P - 1)


def oktopk(n, k, P, rank=None, stats=None, selected_per_region=None, repartition=False,
           exact=False, value_bytes=4):
    """Ok-Topk (``repartition``: the call recomputes the regions; ``exact``: it computes the
    exact threshold). ``stats`` (:func:`data_stats` over the call's regions) and
    ``selected_per_region`` (entries each region selects) default to the uniform model with k
    selected in equal parts."""
    if P <= 1:
        return Volume()
    stats = uniform_stats(n, k, P) if stats is None else stats
    if rank is None:
        return _mean(lambda r: oktopk(n, k, P, r, stats, selected_per_region, repartition, exact,
                                      value_bytes), P)
    ib, vb = index_bytes(n), value_bytes
    v = header(P) + _split_and_reduce(stats, P, rank, ib + vb)
    if repartition:                                   # average of the cut points: P int64
        v = v + _ring_allreduce(P, 8, P, rank)
    v = v + _both(16 * (P - 1), P - 1)                # (selected, support) table
    if selected_per_region is None:
        selected_per_region = equal_parts(k, P)
    if exact:
        target = min(k, int(sum(stats.union)))
        region_entries = [int(u) for u in stats.union]
        gather = max(min(c, target) for c in region_entries) * 4 * (P - 1)
        radix = 4 * _BUCKETS * 8 * 2 * (P - 1) / P
        v = v + _both(8 * (P - 1), P - 1)             # entry counts
        if gather < radix:
            take = min(region_entries[rank], target)
            v = v + Volume(take * 4 * (P - 1), sum(min(c, target) for c in region_entries) * 4 - take * 4,
                           P - 1, P - 1)
        else:
            for _ in range(_RADIX_PASSES):
                v = v + _ring_allreduce(_BUCKETS, 8, P, rank)
        v = v + _both(16 * (P - 1), P - 1) + _both(8 * (P - 1), P - 1)   # ties, then counts
    return v + balance(selected_per_region, P, rank, ib + vb)


def volume(algorithm, n, k, P, rank=None, **details):
    """The :class:`Volume` of one call of ``algorithm`` (one of :data:`ALGORITHMS`); ``details``
    go to its function (``stats``, ``counts``, ``selected``, ...)."""
    if algorithm == "dense":
        return dense(n, P, rank)
    if algorithm == "allgather":
        return allgather(k, P, rank, n=n, **details)
    if algorithm == "gtopk":
        return gtopk(k, P, rank, n=n, **details)
    if algorithm == "dsa":
        return dsa(n, k, P, rank, **details)
    if algorithm == "oktopk":
        return oktopk(n, k, P, rank, **details)
    raise ValueError(f"unknown algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


# ------------------------------------------------------------------ Ok-Topk's data-decided parts
def oktopk_bounds(selections, n):
    """Ok-Topk's regions from the ranks' sorted selections: the average of their cut points
    (:func:`horovod_sparse.exchange.regions.repartition`, without MPI)."""
    P = len(selections)
    cuts, contributors = np.zeros(P - 1, dtype=np.int64), 0
    for s in selections:
        if len(s):
            cuts += np.asarray(s, dtype=np.int64)[[(j * len(s)) // P for j in range(1, P)]]
            contributors += 1
    if not contributors:
        return np.array([(j * n) // P for j in range(P + 1)], dtype=np.int64)
    return np.concatenate(([0], cuts // contributors, [n])).astype(np.int64)


def selected_per_region(selections, values, bounds, k):
    """Entries each region selects at the exact threshold: the k largest |sum| of the ranks'
    sparse vectors (summed in float64, ties to the lower index), counted region by region."""
    indices = np.concatenate([np.asarray(s, dtype=np.int64) for s in selections])
    sums = np.concatenate([np.asarray(v, dtype=np.float64) for v in values])
    support, inverse = np.unique(indices, return_inverse=True)
    total = np.zeros(support.size)
    np.add.at(total, inverse, sums)
    magnitude = np.abs(total.astype(np.float32))      # the engine selects on the float32 sums
    take = min(k, support.size)
    order = np.lexsort((support, -magnitude))[:take]
    chosen = np.sort(support[order])
    return [int(c) for c in np.diff(np.searchsorted(chosen, bounds))]


def paper_elements(algorithm, n, k, P):
    """The Ok-Topk paper's volume per rank in elements (an index or a value is one element):
    TopkA 2k(P-1), gTop-k 4k log2 P, Ok-Topk below 6k(P-1)/P, TopkDSA at most (2k + n)(P-1)/P
    (the upper end), dense 2n(P-1)/P."""
    if P <= 1:
        return 0.0
    return {"dense": 2.0 * n * (P - 1) / P, "allgather": 2.0 * k * (P - 1),
            "gtopk": 4.0 * k * math.log2(P), "oktopk": 6.0 * k * (P - 1) / P,
            "dsa": (2.0 * k + n) * (P - 1) / P}[algorithm]
