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


def orthonormalize_batched(torch, batch):
    """The same Gram-Schmidt on the device, in float32, over a batch of matrices at once, in place.

    batch : torch tensor ``(count, rows, r)`` (a run's summed P's or Q's, :mod:`.batched`), on
    the device that uses them, as PyTorch's ``batched_powerSGD_hook`` orthogonalises: the
    launches grow with the columns, not with the matrices, and nothing crosses to the host.
    Each column's norm is taken of the column divided by its largest magnitude, so that float32
    squares of small gradients neither underflow nor overflow; a column whose remaining norm is
    exactly zero is set to zero (no count: that would read back); NaN/inf propagate. Every rank
    holds the same sums and runs the same kernels, so on devices of one kind every rank gets the
    same bits; they are within float32 rounding of :func:`orthonormalize`'s, not equal to them.
    Returns ``batch``.
    """
    r = batch.shape[2]
    for i in range(r):
        col = batch[:, :, i:i + 1]  # (count, rows, 1)
        scale = col.abs().amax(dim=1, keepdim=True)
        scale = torch.where(scale == 0, 1.0, scale)
        norm = scale * torch.linalg.vector_norm(col / scale, dim=1, keepdim=True)
        col.copy_(torch.where(norm == 0, 0.0, col / norm))
        if i + 1 < r:
            rest = batch[:, :, i + 1:]
            # projections of the later columns on this one, removed (rows summed by one reduction)
            rest -= col * (col * rest).sum(dim=1, keepdim=True)
    return batch
