"""The in-band compressors' CPU kernels: random-k's passes fused, and the sort of its indices.

Random-k's round trip with numpy or torch ops is five passes and a sort: ``acc = grad +
residual``, the overflow check of ``acc``, the gather of the k random entries, zeroing them
in ``acc`` (compress), then zeroing the result and scattering the reduced values into it
(decompress); ``np.sort`` of the k indices takes as long as a copy of the gradient. Here:

* :func:`accumulate_pick`: ``acc = grad + residual``, the count of non-finite entries, the
  gather and the zeroing of the sent entries, in one pass (the indices are sorted, so the
  pass walks the gaps between them);
* :func:`scatter_dense`: the dense result (zeros, the values at the indices) in one pass (not
  fused into compress: a caller may read the gradient between compress and decompress);
* :func:`sort_distinct`: the sorted indices by a bucket sort, O(k) (distinct integers: any
  correct sort gives the same array as ``np.sort``; ``np.sort`` of 250k int64 takes ~10 ms).

Every sparsifier also reads and zeroes its selected entries one by one (:func:`gather_at`,
:func:`zero_at`: ``acc[indices]``, and ``acc[indices] = 0`` once the exchange succeeded). These
loads and stores miss the cache (a 1% selection of 100 MB touches 250,000 lines); a plain loop
keeps more of them in flight than torch's ``index_fill_`` (4.6 against 9.7 ms for top-k's
residual in the round trip of ``scripts/bench_codecs.py``: ``studies/time_indexed.py``).

Per element the same float operations as the numpy/torch path, in the same order (one IEEE
add; zero is +0.0), so both give the same bits. float32 and float64 buffers (float16 and
bfloat16 gradients keep torch's ops). The fp16 cast itself needs no kernel: torch's
conversion into a preallocated buffer runs at memory speed (:mod:`horovod_sparse.compressors.cast`).

Example::

    bad = accumulate_pick(grad, residual, acc, indices, values)   # bad == 0: all finite
    scatter_dense(out, indices, values)
"""
import numpy as np

from horovod_sparse.ops.cpu import jit


@jit
def accumulate_pick(grad, residual, acc, indices, values):
    """``acc = grad + residual``; ``values = acc[indices]``, then ``acc[indices] = 0``. Returns how
    many entries of ``grad + residual`` are not finite (0: all are). ``indices`` sorted, distinct,
    in range; 1-D contiguous buffers, ``acc`` of ``grad``'s length, ``values`` of ``indices``'."""
    # unsigned positions: no negative-index wraparound per element, so LLVM vectorises the gaps
    one = np.uint64(1)
    bad = np.uint64(0)
    start = np.uint64(0)
    for j in range(indices.size):
        stop = np.uint64(indices[j])
        for i in range(start, stop):  # the gap before the next sent entry
            a = grad[i] + residual[i]
            acc[i] = a
            bad += np.uint64((a - a) != 0)  # inf - inf and NaN - NaN are NaN; x - x is 0 if finite
        a = grad[stop] + residual[stop]
        values[j] = a
        acc[stop] = 0
        bad += np.uint64((a - a) != 0)
        start = stop + one
    for i in range(start, np.uint64(grad.size)):
        a = grad[i] + residual[i]
        acc[i] = a
        bad += np.uint64((a - a) != 0)
    return bad


@jit
def scatter_dense(out, indices, values, offset=0):
    """``out[:] = 0; out[indices - offset] = values`` in one pass (``indices`` sorted, distinct;
    ``offset``: where ``out`` starts in the buffer the indices point into, so that a fused
    buffer's indices need no relative copy)."""
    one = np.uint64(1)
    start = np.uint64(0)
    for j in range(indices.size):
        stop = np.uint64(indices[j] - offset)
        for i in range(start, stop):
            out[i] = 0
        out[stop] = values[j]
        start = stop + one
    for i in range(start, np.uint64(out.size)):
        out[i] = 0


@jit
def sort_distinct(values, n):
    """``np.sort(values)`` for distinct integers in ``[0, n)``: a bucket sort (bucket ``v * k / n``
    in float64, monotone in ``v``: no integer division), then an insertion sort, which moves
    entries only within their bucket and makes the result sorted whatever the buckets. O(k) for
    random draws, as random-k's are."""
    k = values.size
    out = np.empty(k, np.int64)
    if k == 0:
        return out
    scale = k / n
    last = k - 1
    bucket = np.empty(k, np.int64)
    start = np.zeros(k + 1, np.int64)
    for i in range(k):
        b = min(np.int64(values[i] * scale), last)
        bucket[i] = b
        start[b + 1] += 1
    for b in range(k):
        start[b + 1] += start[b]
    for i in range(k):
        b = bucket[i]
        out[start[b]] = values[i]
        start[b] += 1
    for i in range(1, k):  # buckets are in order: only each bucket's few entries move
        v = out[i]
        j = i - 1
        while j >= 0 and out[j] > v:
            out[j + 1] = out[j]
            j -= 1
        out[j + 1] = v
    return out


@jit
def gather_at(x, indices, out):
    """``out[:] = x[indices]``; returns how many indices are outside ``[0, x.size)`` (none is
    read: the caller raises, as numpy's indexing would)."""
    n = x.size
    bad = 0
    for j in range(indices.size):
        i = indices[j]
        if 0 <= i < n:
            out[j] = x[i]
        else:
            bad += 1
    return bad


@jit
def zero_at(x, indices):
    """``x[indices] = 0``; returns how many indices are outside ``[0, x.size)`` (then nothing is
    written: a state buffer is never left half cleared)."""
    n = x.size
    bad = 0
    for j in range(indices.size):
        bad += not (0 <= indices[j] < n)
    if bad:
        return bad
    for j in range(indices.size):
        x[indices[j]] = 0
    return 0
