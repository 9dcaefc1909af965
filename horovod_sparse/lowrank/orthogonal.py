"""Deterministic Gram-Schmidt orthonormalisation of the columns of a tall matrix.

PowerSGD orthogonalises the summed P, which every rank holds bitwise identical, and
every rank must obtain the same orthonormal basis from it. Only element-wise numpy
operations and numpy's own reductions are used (no BLAS: a multi-threaded BLAS may
split a dot product differently on different ranks), in float64 so that the squares
of small float32 gradients neither underflow nor lose digits.

It runs on the host, where the summed P arrives from MPI, whatever the gradient's device:
the factor is small (rows x r), numpy's element-wise code gives the same bits on every
rank whatever its device, library or thread count (a GPU's reductions need not match a
CPU's), and the orthonormal basis crosses to the device instead of the raw sum: no extra
traffic.
"""
import numpy as np


def orthonormalize(matrix):
    """Classical-order Gram-Schmidt (as PyTorch's ``_orthogonalize_gram_schmidt``) in float64.

    matrix : (rows, r) array. Returns ``(basis, zero_columns)``: ``basis`` a new float64
    (rows, r) array whose nonzero columns are orthonormal (for a full-column-rank input
    it equals the Q of the QR factorisation with a positive diagonal R); a column whose
    remaining norm is exactly zero (a zero gradient, a repeated column) is set to zero
    instead of dividing by zero, and counted in ``zero_columns``. NaN/inf propagate.
    """
    basis = np.array(matrix, dtype=np.float64, copy=True)
    rows, r = basis.shape
    zero_columns = 0
    for i in range(r):
        col = basis[:, i]
        norm = np.sqrt(np.sum(col * col))
        if norm == 0:
            col[:] = 0.0
            zero_columns += 1
            continue
        col /= norm
        if i + 1 < r:
            rest = basis[:, i + 1:]
            # Projections of the later columns on this one, removed (rows summed in
            # a fixed order by numpy's axis-0 reduction).
            rest -= np.sum(col[:, None] * rest, axis=0) * col[:, None]
    return basis, zero_columns
