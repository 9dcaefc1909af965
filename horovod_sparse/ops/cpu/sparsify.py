"""The sparsifiers' first pass, fused: error feedback, the overflow check and the candidates.

What it replaces (numpy, one pass each, :mod:`horovod_sparse.memory` and
:mod:`horovod_sparse.sparsify.selection`): ``acc = grad + residual``; ``all_finite(acc)``;
``keys = |acc|`` as int32 (:func:`~horovod_sparse.ops.magnitude.magnitude_keys`);
``keys >= floor`` into a mask; the mask's indices. Here that is one loop over 64-entry
blocks: each block's sums are written, its keys compared with the floor into a 64-bit
mask (vectorised), and only the marked entries are visited (:func:`~horovod_sparse.ops.cpu.cttz`),
so the pass reads the gradient and the residual and writes the sums once: the memory bound
of error feedback, with the selection's candidates for free.

The candidates are every entry whose key is at least ``floor``, in index order, with their
keys: a selection rule that asks for the entries at or above any key >= floor gets them from
the candidates (O(candidates)) instead of a pass over the buffer. Their count goes on past
the buffer's capacity (only the first ones are written), so a caller knows when the set is
incomplete and takes the full path.

Bits: the sums are the same float32 additions as numpy's (one per element, no fast-math),
the keys are integers, so everything downstream is the numpy path's, bit for bit.

Example::

    count, nonfinite = accumulate_scan(grad, residual, acc, floor, cand_index, cand_key, 0, 0)
    # acc == grad + residual; cand_index[:count] == np.flatnonzero(magnitude_keys(acc) >= floor)
"""
import numpy as np

from horovod_sparse.ops.cpu import cttz, inlined, jit, popcount

#: the key of +inf: keys at or above it are inf or NaN (an overflow)
INF_KEY = 0x7F800000
#: the largest key (a NaN): the floor of a pass that wants the overflow count, hardly any candidates
NO_FLOOR = 0x7FFFFFFF
_BLOCK = 64


@inlined
def _collect(bits, lo, size, floor, base, cand_index, cand_key, count):
    """Append (base + i, key) of the entries lo <= i < lo + size (size <= 64) with key >= floor;
    returns (count, how many keys are inf or NaN)."""
    mask = np.uint64(0)
    bad = 0
    for j in range(size):
        key = bits[lo + j] & 0x7FFFFFFF
        mask |= np.uint64(key >= floor) << np.uint64(j)
        bad += key >= INF_KEY
    cap = cand_index.shape[0]
    if count >= cap:  # the buffers are full: count the rest only
        return count + np.int64(popcount(mask)), bad
    while mask:
        i = lo + np.int64(cttz(mask))
        mask &= mask - np.uint64(1)
        if count < cap:
            cand_index[count] = base + i
            cand_key[count] = bits[i] & 0x7FFFFFFF
        count += 1
    return count, bad


@jit
def accumulate_scan(grad, residual, acc, floor, cand_index, cand_key, count, base):
    """``acc = grad + residual`` (float32, 1-D, same length; acc may be neither input), and the
    candidates of acc at or above ``floor`` (an int32 key) appended at ``count`` (indices
    offset by ``base``). Returns ``(count, nonfinite)``: the candidates found so far in all,
    and how many entries of acc are inf or NaN."""
    bits = acc.view(np.int32)
    n = acc.shape[0]
    bad = 0
    full = n - n % _BLOCK
    for lo in range(0, full, _BLOCK):  # whole blocks: a fixed trip count, so the loops vectorise
        for j in range(_BLOCK):
            acc[lo + j] = grad[lo + j] + residual[lo + j]
        count, b = _collect(bits, lo, _BLOCK, floor, base, cand_index, cand_key, count)
        bad += b
    for i in range(full, n):
        acc[i] = grad[i] + residual[i]
    count, b = _collect(bits, full, n - full, floor, base, cand_index, cand_key, count)
    return count, bad + b


@jit
def momentum_scan(grad, velocity, residual, momentum, velocity_out, acc, floor, cand_index, cand_key,
                  count, base):
    """DGC's momentum correction (:class:`~horovod_sparse.memory.MomentumCorrection`) fused:
    ``u = momentum * velocity + grad`` into ``velocity_out`` (the multiply, then the add, in
    float32, as numpy's two passes), ``acc = residual + u``, and the candidates as
    :func:`accumulate_scan`."""
    bits = acc.view(np.int32)
    n = acc.shape[0]
    bad = 0
    full = n - n % _BLOCK
    for lo in range(0, full, _BLOCK):
        for j in range(_BLOCK):
            u = velocity[lo + j] * momentum + grad[lo + j]
            velocity_out[lo + j] = u
            acc[lo + j] = residual[lo + j] + u
        count, b = _collect(bits, lo, _BLOCK, floor, base, cand_index, cand_key, count)
        bad += b
    for i in range(full, n):
        u = velocity[i] * momentum + grad[i]
        velocity_out[i] = u
        acc[i] = residual[i] + u
    count, b = _collect(bits, full, n - full, floor, base, cand_index, cand_key, count)
    return count, bad + b


@jit
def scan(acc, floor, cand_index, cand_key, count, base):
    """The candidates and the overflow count of an ``acc`` already written (no error feedback)."""
    bits = acc.view(np.int32)
    n = acc.shape[0]
    bad = 0
    full = n - n % _BLOCK
    for lo in range(0, full, _BLOCK):
        count, b = _collect(bits, lo, _BLOCK, floor, base, cand_index, cand_key, count)
        bad += b
    count, b = _collect(bits, full, n - full, floor, base, cand_index, cand_key, count)
    return count, bad + b


@jit
def take_top(cand_index, cand_key, kth, k, out):
    """The exact top-k among candidates in index order whose k-th largest key is ``kth``:
    every candidate above it, then the lowest-indexed ones at it, ``k`` in all, into
    ``out[:k]``; returns how many were written. What numpy's comparison, count, compaction of
    the ties and gather do in four passes (:func:`~horovod_sparse.sparsify.selection.top_k`)."""
    above = 0
    for j in range(cand_key.shape[0]):
        above += cand_key[j] > kth
    ties = k - above
    written = 0
    for j in range(cand_key.shape[0]):
        key = cand_key[j]
        if key > kth or (key == kth and ties > 0):
            ties -= key == kth
            out[written] = cand_index[j]
            written += 1
    return written


@jit
def sorted_membership(a, b, out):
    """``out[i] = a[i] in b`` for sorted unique 1-D integer arrays (one merge of the two, O(|a| +
    |b|)): Ok-Topk's and gTop-k's local selection against the global one (step 5 of a sparse
    step). What ``np.isin`` finds by sorting both again (5.1 against 2.4 ms at 258,610 indices: ``studies/time_kernels.py``)."""
    j, m = 0, b.shape[0]
    for i in range(a.shape[0]):
        v = a[i]
        while j < m and b[j] < v:
            j += 1
        out[i] = j < m and b[j] == v


@jit
def sorted_runs(index, bounds):
    """Where the sorted (non-decreasing) runs of ``index`` start, into ``bounds`` (``bounds[r]``
    the start of run r, then ``bounds[runs] = n``); returns ``runs``, or ``bounds.shape[0]``
    (nothing more written) once there are more runs than ``bounds`` holds starts for."""
    n = index.shape[0]
    if n == 0:
        bounds[0] = 0
        return 0
    most = bounds.shape[0] - 1
    bounds[0], runs = 0, 1
    for i in range(1, n):
        if index[i] < index[i - 1]:
            if runs == most:
                return most + 1
            bounds[runs] = i
            runs += 1
    bounds[runs] = n
    return runs


@jit
def _merge_sum(a_index, a_values, a_lo, a_hi, b_index, b_values, b_lo, b_hi, out_index, out_sum):
    """Merge the sorted ``a[a_lo:a_hi]`` and ``b[b_lo:b_hi]`` into unique indices and sums: equal
    indices summed in float64 in order (a's before b's, each side in its own order), an index's
    first value plus 0.0, as :func:`~horovod_sparse.exchange.sparse_ops.sum_duplicates` adds them;
    each sum is stored (cast to ``out_sum``'s dtype) once its index is done. Returns the entries."""
    i, j, c = a_lo, b_lo, 0
    have = False
    last = np.int64(0)
    total = 0.0
    while i < a_hi or j < b_hi:
        if j >= b_hi or (i < a_hi and a_index[i] <= b_index[j]):
            x, v = np.int64(a_index[i]), np.float64(a_values[i])
            i += 1
        else:
            x, v = np.int64(b_index[j]), np.float64(b_values[j])
            j += 1
        if have and x == last:
            total += v
        else:
            if have:
                out_index[c] = last
                out_sum[c] = total
                c += 1
            last, total, have = x, v + 0.0, True
    if have:
        out_index[c] = last
        out_sum[c] = total
        c += 1
    return c


@jit
def sum_sorted_runs(index, values, bounds, out_index, out_sum, spare_index, spare_sum):
    """The sum of a concatenation of sorted runs (one per rank, as an allgather delivers them;
    ``bounds``: where they start, then the length, as :func:`sorted_runs` finds them): unique
    indices and their sums into ``out`` (sums in its dtype); returns the entries. The first
    two runs are merged, then each next one into what the earlier made (float64 sums in
    ``spare``, two buffers of the input's length from three runs on, else unused), so every
    index's values are added in the order they come, as the stable sort + ``np.add.at`` of
    :func:`~horovod_sparse.exchange.sparse_ops.sum_duplicates` adds them: the same bits, in
    one pass per run instead of a sort (TopkA's merge of (P-1)k received pairs; the warm-up's
    large counts)."""
    runs = bounds.shape[0] - 1
    n = bounds[runs]
    if runs <= 2:
        middle = bounds[1] if runs == 2 else n
        return _merge_sum(index, values, 0, middle, index, values, middle, n, out_index, out_sum)
    count = _merge_sum(index, values, 0, bounds[1], index, values, bounds[1], bounds[2],
                       spare_index[0], spare_sum[0])
    src = 0
    for r in range(2, runs):
        lo, hi = bounds[r], bounds[r + 1]
        if r == runs - 1:
            return _merge_sum(spare_index[src], spare_sum[src], 0, count, index, values, lo, hi, out_index, out_sum)
        count = _merge_sum(spare_index[src], spare_sum[src], 0, count, index, values, lo, hi,
                           spare_index[1 - src], spare_sum[1 - src])
        src = 1 - src
    return count
