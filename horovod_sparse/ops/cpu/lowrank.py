"""PowerSGD's element-wise passes, fused (and error feedback with its overflow check, which
the FFT pipeline shares).

What they replace (numpy, a pass each, :mod:`horovod_sparse.memory`,
:mod:`horovod_sparse.ops.finite` and :mod:`horovod_sparse.lowrank.factors`):

* :func:`accumulate_finite`: ``np.add(grad, residual, out=acc)`` then ``all_finite(acc)``:
  one loop that reads the gradient and the residual and writes the sums, telling whether
  every sum is finite on the way (an integer OR of ``(v - v) != 0``, vectorised); called
  once per piece where a step's gradients come as pieces (the slices of the residual and
  of acc at the piece's offset), so the pieces are read where they are, never fused first;
* :func:`copy_finite`: the same without error feedback, ``acc[...] = grad`` then
  ``all_finite(acc)`` (the pieces fused into a reused buffer, checked on the way);
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

    finite = accumulate_finite(grad, residual, acc)     # acc = grad + residual
    finite = copy_finite(piece, acc[offset:offset + piece.size])   # acc's slice = piece
    expand_residual(out, acc, p_t, q_sum_t, q_local_t, full, cols, tail, True)
"""
import numpy as np

from horovod_sparse.ops.cpu import inlined, jit


@jit
def accumulate_finite(grad, residual, acc):
    """``acc = grad + residual`` (float32, 1-D, same length); returns True when every element
    of acc is finite. Replaces ``np.add(grad, residual, out=acc)`` + ``all_finite(acc)``."""
    bad = np.uint8(0)
    for i in range(acc.shape[0]):
        v = grad[i] + residual[i]
        acc[i] = v
        bad |= np.uint8((v - v) != np.float32(0))  # inf - inf and NaN - NaN are NaN
    return bad == 0


@jit
def copy_finite(grad, acc):
    """``acc[:] = grad`` (float32, 1-D, same length); returns True when every element is finite.
    Replaces ``acc[...] = grad`` + ``all_finite(acc)``."""
    bad = np.uint8(0)
    for i in range(acc.shape[0]):
        v = grad[i]
        acc[i] = v
        bad |= np.uint8((v - v) != np.float32(0))
    return bad == 0


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
