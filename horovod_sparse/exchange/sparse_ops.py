"""Local (no-communication) operations on sparse vectors held as (indices, values).

All functions are deterministic: the same inputs give bitwise-identical outputs
on every rank, which is what lets the algorithms agree without extra checks.
"""
import numpy as np

from horovod_sparse.ops import cpu, magnitude
from horovod_sparse.ops.cpu.sparsify import sorted_runs, sum_sorted_runs

#: at most this many sorted runs are merged one after another by the compiled kernel (each
#: merge reads what the earlier ones made: P/2 passes against the sort's log2 P); more: the sort
MERGED_RUNS = 16

#: the exchange's magnitude keys are unsigned (what its radix select counts), by value size
_UNSIGNED = {4: np.uint32, 8: np.uint64}


def wire_index_dtype(n):
    """int32 when every index in [0, n) fits it (n < 2**31), else int64."""
    return np.dtype(np.int32) if n < 2 ** 31 else np.dtype(np.int64)


def magnitude_keys(values):
    """Unsigned keys ordered like ``abs(values)`` (NaN largest); float32/float64 only: the
    :func:`~horovod_sparse.ops.magnitude.magnitude_keys` of ``values``, read as unsigned."""
    keys = magnitude.magnitude_keys(np.ascontiguousarray(values))
    return keys.view(_UNSIGNED[keys.itemsize])


def threshold_key(threshold, value_dtype):
    """The magnitude key of a float ``threshold`` rounded to ``value_dtype`` (unsigned scalar)."""
    value_dtype = np.dtype(value_dtype)
    return _UNSIGNED[value_dtype.itemsize](magnitude.key_of(threshold, value_dtype))


def key_to_magnitude(key, value_dtype):
    """Inverse of :func:`threshold_key`: the float magnitude whose key is ``key``."""
    return magnitude.magnitude_of(key, value_dtype)


def sum_duplicates(index_pieces, value_pieces, value_dtype):
    """Sum several sparse vectors: sorted unique indices (int64) and their sums.

    Sums are accumulated in float64 in the order the pieces are given, starting from 0.0
    (then cast to ``value_dtype``), so the result depends only on the inputs, never on
    the rank.

    1. Concatenate; a stable sort (timsort: the pieces are usually sorted runs, one per
       rank, which it merges) keeps equal indices in piece order.
    2. The first entry of each index starts its sum (0.0 + value); the later ones are
       added in order (``np.add.at``, sequential), each a value of another piece.

    With the compiled kernels, steps 1 and 2 are one merge per sorted run
    (:func:`~horovod_sparse.ops.cpu.sparsify.sum_sorted_runs`, up to :data:`MERGED_RUNS` runs):
    the same additions in the same order, so the same bits.
    """
    value_dtype = np.dtype(value_dtype)
    if not index_pieces:
        return np.empty(0, np.int64), np.empty(0, value_dtype)
    if len(index_pieces) == 1:  # read where it is (an allgather's strided records, say)
        indices, values = np.asarray(index_pieces[0]), np.asarray(value_pieces[0])
    else:
        indices = np.concatenate([np.asarray(p) for p in index_pieces])            # step 1
        values = np.concatenate([np.asarray(p) for p in value_pieces])
    if cpu.enabled() and indices.size and indices.dtype.kind in "iu" and values.dtype.kind == "f":
        bounds = np.empty(MERGED_RUNS + 1, np.int64)
        runs = sorted_runs(indices, bounds)
        if runs <= MERGED_RUNS:
            out_index, out_sum = np.empty(indices.size, np.int64), np.empty(indices.size, value_dtype)
            spare = (2, indices.size) if runs > 2 else (2, 0)
            count = sum_sorted_runs(indices, values, bounds[:runs + 1], out_index, out_sum,
                                    np.empty(spare, np.int64), np.empty(spare, np.float64))
            return out_index[:count], out_sum[:count]
    if indices.size > 1 and not np.all(indices[1:] > indices[:-1]):
        order = np.argsort(indices, kind="stable")
        indices, values = indices[order], values[order]
    first = np.empty(indices.size, dtype=bool)                                      # step 2
    first[:1] = True
    np.not_equal(indices[1:], indices[:-1], out=first[1:])
    sums = values[first].astype(np.float64) + 0.0  # + 0.0: a sum of -0.0 alone is 0.0
    later = np.flatnonzero(~first)
    if later.size:
        starts = np.flatnonzero(first)
        np.add.at(sums, np.searchsorted(starts, later, side="right") - 1, values[later].astype(np.float64))
    return indices[first].astype(np.int64), sums.astype(value_dtype)


def top_k_by_magnitude(indices, values, k):
    """The ``k`` entries of largest |value| (ties: smaller index first), sorted by index.

    ``indices`` must be sorted. O(m): one partition finds the k-th largest magnitude key,
    everything above it is kept, and the first (lowest-index) ties fill up to ``k``.
    """
    if indices.size <= k:
        return indices, values
    keys = magnitude_keys(values)
    kth = np.partition(keys, keys.size - k)[keys.size - k]
    keep = keys > kth
    ties = np.flatnonzero(keys == kth)[:k - int(np.count_nonzero(keep))]
    keep[ties] = True
    return indices[keep], values[keep]


def values_at(indices, values, targets):
    """Values of the sparse vector (sorted ``indices``, ``values``) at ``targets`` (0 where absent)."""
    out = np.zeros(targets.size, dtype=values.dtype)
    if indices.size and targets.size:
        pos = np.searchsorted(indices, targets)
        pos_clipped = np.minimum(pos, indices.size - 1)
        hit = indices[pos_clipped] == targets
        out[hit] = values[pos_clipped[hit]]
    return out


def _require_sorted_unique(name, array):
    if array.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {array.shape}")
    if array.size > 1 and not np.all(array[1:] > array[:-1]):
        raise ValueError(f"{name} must be sorted ascending and unique")


def intersect_sorted(a, b):
    """Intersection of two sorted, unique integer arrays (sorted int64 result).

    Both inputs are checked: the reference code intersected unsorted index lists
    with a sorted-input routine and silently got wrong residuals.  For a local
    selection in arbitrary order use :func:`mask_in_sorted` instead.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    _require_sorted_unique("a", a)
    _require_sorted_unique("b", b)
    return np.asarray(a[mask_in_sorted(a, b)], dtype=np.int64)


def mask_in_sorted(local_indices, selected):
    """Boolean mask over ``local_indices`` (ANY order): which are in ``selected``.

    ``selected`` must be sorted and unique (e.g. ``ExchangeResult.selected``).
    This is the residual rule of Ok-Topk: the residual is cleared exactly where
    ``mask_in_sorted(local, result.selected)`` is True (local ∩ global).
    """
    local_indices = np.asarray(local_indices)
    selected = np.asarray(selected)
    _require_sorted_unique("selected", selected)
    if selected.size == 0 or local_indices.size == 0:
        return np.zeros(local_indices.shape, dtype=bool)
    pos = np.searchsorted(selected, local_indices)
    pos = np.minimum(pos, selected.size - 1)
    return selected[pos] == local_indices
