"""PowerSGD's element-wise passes, fused (its first pass, error feedback with the overflow
check, is :mod:`horovod_sparse.ops.cpu.memory`'s).

What they replace (numpy, a pass each, :mod:`horovod_sparse.memory`,
:mod:`horovod_sparse.ops.finite` and :mod:`horovod_sparse.lowrank.factors`):

* :func:`expand_residual`: step 6 of PowerSGD, ``expand_block`` twice (the result
  ``out = P Qsum^T`` and the residual ``acc -= P Qlocal^T``): one loop over the block's
  rows that writes both, each product made row by row in a cache-resident row buffer
  (numpy: a product chunk, a temporary and a subtraction per rank column, per chunk).

The products P = M Q and Q = M^T P stay BLAS (numpy on zero-copy views): they read the
buffer once each at the memory bound, and their rounding is BLAS's.

Bits: every element gets the same float32 operations in the same order as numpy's
(``p[0]*q[0]``, then ``+ p[j]*q[j]`` for j = 1 .. r-1, then ``acc - that``; no fast-math, no
FMA contraction), so the results are numpy's bit for bit.

Example::

    expand_residual(out, acc, p_t, q_sum_t, q_local_t, full, cols, tail, True)
"""
import numpy as np

from horovod_sparse.ops.cpu import inlined, jit


@inlined
def _row_product(p_t, i, q_t, width, row):
    """``row[:width] = sum_j p_t[j, i] * q_t[j, :width]`` in order of j (numpy's :func:`expand`)."""
    pi = p_t[0, i]
    for c in range(width):
        row[c] = pi * q_t[0, c]
    for j in range(1, p_t.shape[0]):
        pj = p_t[j, i]
        for c in range(width):
            row[c] = row[c] + pj * q_t[j, c]


@jit
def expand_residual(out, acc, p_t, q_sum_t, q_local_t, full, cols, tail, subtract):
    """One block (flat, row-major, ``full`` rows of ``cols`` then a short row of ``tail``):
    ``out = P q_sum^T`` and, with ``subtract``, ``acc -= P q_local^T``. ``p_t`` (r, >= rows),
    ``q_sum_t`` and ``q_local_t`` (r, cols): float32 factors transposed (contiguous).

    Replaces ``expand_block(lib, out, p_t, q_sum_t, ...)`` and ``expand_block(lib, acc, p_t,
    q_local_t, ..., subtract=True)`` of :mod:`horovod_sparse.lowrank.factors`."""
    rows = full + (1 if tail > 0 else 0)
    local = np.empty(cols, np.float32)
    for i in range(rows):
        width = cols if i < full else tail
        base = i * cols
        _row_product(p_t, i, q_sum_t, width, out[base:base + width])
        if subtract:
            _row_product(p_t, i, q_local_t, width, local)
            target = acc[base:base + width]
            for c in range(width):
                target[c] = target[c] - local[c]
