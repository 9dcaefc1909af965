"""Exact global top-`target` selection over values spread across ranks.

Used by Ok-Topk's global threshold step.  Each rank holds the reduced values of
its own region (regions are disjoint and ordered by rank).  Two ways find the
exact `target`-th largest magnitude key (see :func:`.sparse_ops.magnitude_keys`),
whichever sends fewer bytes, chosen identically on all ranks from the agreed
candidate counts:

* radix select: one Allreduce of 256 int64 counts per byte of the key (4 for
  float32) - a few KiB whatever `target` is, the better choice for large `target`;
* candidate gather: every rank allgathers its own top-min(target, count) keys and
  all ranks pick the threshold from those - cheaper when `target` is small
  (a model of ten thousand parameters at 1% density selects about a hundred).

Ties at the threshold are broken by index (lower ranks own lower indices), so
exactly ``target`` entries are selected, the same ones either way.
"""
import numpy as np
from mpi4py import MPI

_DIGIT_BITS = 8
_BUCKETS = 1 << _DIGIT_BITS


def exact_select(comm, keys, target):
    """Select exactly ``target`` entries of largest key over all ranks.

    Parameters
    ----------
    comm : CountingComm
    keys : this rank's unsigned magnitude keys (uint32 or uint64).
    target : number of entries to select globally (0 <= target <= total entries,
        identical on all ranks).

    Returns (mask over ``keys``, threshold key T): selected entries are all keys > T
    plus the lowest-index ties == T.
    """
    key_dtype = keys.dtype
    if target <= 0:
        return np.zeros(keys.size, dtype=bool), np.iinfo(key_dtype).max
    counts = np.empty(comm.size, dtype=np.int64)
    comm.allgather(np.array([keys.size], dtype=np.int64), counts, control=True)
    if _gather_is_cheaper(counts, target, keys.itemsize, comm.size):
        threshold = _threshold_from_candidates(comm, keys, counts, target)
    else:
        threshold = _radix_threshold(comm, keys, target)
    return _select_above_with_ties(comm, keys, threshold, target), threshold


def _gather_is_cheaper(counts, target, key_bytes, size):
    """Bytes the busiest rank sends: gathering its candidates vs the radix passes' ring allreduces."""
    gather = int(np.minimum(counts, target).max()) * key_bytes * (size - 1)
    radix = key_bytes * _BUCKETS * 8 * 2 * (size - 1) / size
    return gather < radix


def _threshold_from_candidates(comm, keys, counts, target):
    """The ``target``-th largest key overall. Only a rank's own top ``target`` keys can be
    among the overall top ``target``, so those are all that is gathered."""
    take = np.minimum(counts, target)
    own = keys if keys.size <= target else np.partition(keys, keys.size - target)[keys.size - target:]
    gathered = comm.allgatherv(np.ascontiguousarray(own, dtype=keys.dtype), take, control=True)
    return keys.dtype.type(np.partition(gathered, gathered.size - target)[gathered.size - target])


def _radix_threshold(comm, keys, target):
    """The ``target``-th largest key overall, one digit of 8 bits per Allreduce of counts."""
    key_dtype = keys.dtype
    candidates = keys
    prefix = 0
    remaining = int(target)  # entries still to find among keys matching the prefix
    for shift in range(keys.itemsize * 8 - _DIGIT_BITS, -1, -_DIGIT_BITS):
        digits = (candidates >> key_dtype.type(shift)).astype(np.intp) & (_BUCKETS - 1)
        local_hist = np.bincount(digits, minlength=_BUCKETS).astype(np.int64)
        hist = np.empty_like(local_hist)
        comm.allreduce(local_hist, hist, op=MPI.SUM, control=True)
        from_top = np.cumsum(hist[::-1])
        top_pos = int(np.searchsorted(from_top, remaining))  # first digit (from the top) reaching it
        digit = _BUCKETS - 1 - top_pos
        remaining -= int(from_top[top_pos] - hist[digit])
        prefix |= digit << shift
        candidates = candidates[digits == digit]
    return key_dtype.type(prefix)


def _select_above_with_ties(comm, keys, threshold, target):
    """Mask of the keys above ``threshold`` plus the lowest-index ties, ``target`` in all."""
    above = keys > threshold
    ties = np.flatnonzero(keys == threshold)
    counts = np.empty((comm.size, 2), dtype=np.int64)  # per rank: (above, ties)
    comm.allgather(np.array([np.count_nonzero(above), ties.size], dtype=np.int64), counts, control=True)
    remaining = int(target) - int(counts[:, 0].sum())
    ties_before = int(counts[:comm.rank, 1].sum())
    take = min(max(remaining - ties_before, 0), ties.size)
    mask = above
    mask[ties[:take]] = True
    return mask
