"""Exact global top-`target` selection over values spread across ranks.

Used by Ok-Topk's global threshold step.  Each rank holds the reduced values of
its own region (regions are disjoint and ordered by rank).  A radix select on the
magnitude keys (see :func:`.sparse_ops.magnitude_keys`) finds the exact k-th
largest |value| with one Allreduce of 256 int64 counts per byte of the key
(4 for float32, 8 for float64) - a few KiB of control traffic instead of
gathering candidate values.  Ties at the threshold are broken by index (lower
ranks own lower indices), so exactly ``target`` entries are selected.
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
    threshold = key_dtype.type(prefix)

    above = keys > threshold
    ties = np.flatnonzero(keys == threshold)
    tie_counts = np.empty(comm.size, dtype=np.int64)
    comm.allgather(np.array([ties.size], dtype=np.int64), tie_counts, control=True)
    ties_before = int(tie_counts[:comm.rank].sum())
    take = min(max(remaining - ties_before, 0), ties.size)
    mask = above
    mask[ties[:take]] = True
    return mask, threshold
