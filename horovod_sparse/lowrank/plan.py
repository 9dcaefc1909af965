"""Which parts of a fused gradient buffer PowerSGD compresses, and how each is viewed as a matrix.

PyTorch's DDP hook rule (Vogels et al., NeurIPS'19, as ``powerSGD_hook``): a gradient of
shape ``(s0, s1, ..., sk)`` with k >= 1 is viewed as the row-major matrix
``(a, b) = (s0, s1*...*sk)``; with ``r = min(rank, a, b)`` it is compressed when
``a * b >= min_compression_rate * r * (a + b)`` (sending P and Q must be at least
``min_compression_rate`` times smaller than sending the matrix; PyTorch uses a strict
``>``, the boundary case is immaterial) and ``r >= 1``. Everything else (1-D gradients,
scalars, small or thin matrices) goes into one dense vector that is summed exactly.

Without a layout the whole buffer is ONE matrix, like PyTorch's ``batched_powerSGD_hook``
but near-square instead of square: ``a = ceil(sqrt(n))``, ``b = ceil(n / a)``, the
``a * b - n < a`` missing elements are zero padding.
"""
import math
from dataclasses import dataclass
from typing import Hashable, Tuple

import numpy as np


@dataclass(frozen=True)
class MatrixBlock:
    """One compressed matrix: buffer elements ``[offset, offset + size)`` viewed row-major as
    ``(rows, cols)`` (the view may extend past the buffer's end into zero padding only
    without a layout, where ``rows * cols - size < rows``), approximated with ``rank``
    columns in P (rows x rank) and Q (cols x rank)."""

    key: Hashable
    offset: int
    size: int
    rows: int
    cols: int
    rank: int


def worth_compressing(rows, cols, rank, min_compression_rate):
    """(compress?, r): r = min(rank, rows, cols); compress when r >= 1 and
    rows*cols >= min_compression_rate * r * (rows + cols)."""
    r = min(int(rank), int(rows), int(cols))
    return r >= 1 and rows * cols >= min_compression_rate * r * (rows + cols), r


def near_square(n):
    """(a, b) with a = ceil(sqrt(n)), b = ceil(n / a): a*b >= n, a*b - n < a; (0, 0) for n = 0."""
    if n <= 0:
        return 0, 0
    a = math.isqrt(n - 1) + 1  # ceil(sqrt(n)) exactly, also for huge n
    return a, -(-n // a)


@dataclass(frozen=True)
class Plan:
    """The split of a buffer of ``n`` elements into compressed matrices and a dense part.

    matrices : tuple of :class:`MatrixBlock`, in buffer order.
    dense_slices : tuple of (start, stop) buffer ranges summed exactly, in buffer order;
        concatenated they form the dense vector of ``dense_size`` elements.
    padded : True when the buffer was viewed as one zero-padded matrix (no layout).
    """

    n: int
    matrices: Tuple[MatrixBlock, ...]
    dense_slices: Tuple[Tuple[int, int], ...]
    padded: bool

    @property
    def dense_size(self):
        return sum(stop - start for start, stop in self.dense_slices)

    @property
    def p_size(self):
        """Elements of all P matrices (sum of rows * rank)."""
        return sum(m.rows * m.rank for m in self.matrices)

    @property
    def q_size(self):
        """Elements of all Q matrices (sum of cols * rank)."""
        return sum(m.cols * m.rank for m in self.matrices)

    def signature(self):
        """A repr that differs whenever two plans would exchange differently."""
        return repr((self.n, self.padded, [(m.offset, m.rows, m.cols, m.rank) for m in self.matrices],
                     self.dense_slices))

    def dense_positions(self):
        """int64 buffer positions of the dense vector, in its order (numpy)."""
        if not self.dense_slices:
            return np.empty(0, np.int64)
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.dense_slices])


def make_plan(n, rank, min_compression_rate, layout=None):
    """The :class:`Plan` of a buffer of ``n`` elements (``layout``: a GradientLayout or None)."""
    matrices, dense = [], []

    def add_dense(start, stop):
        if stop <= start:
            return
        if dense and dense[-1][1] == start:  # merge neighbours: fewer, longer copies
            dense[-1] = (dense[-1][0], stop)
        else:
            dense.append((start, stop))

    if layout is None:
        a, b = near_square(n)
        compress, r = worth_compressing(a, b, rank, min_compression_rate)
        if compress:
            matrices.append(MatrixBlock(None, 0, n, a, b, r))
        else:
            add_dense(0, n)
        return Plan(n, tuple(matrices), tuple(dense), padded=bool(compress))
    for entry in layout.entries:
        if len(entry.shape) >= 2:
            a = int(entry.shape[0])
            b = int(np.prod(entry.shape[1:], dtype=np.int64))
            compress, r = worth_compressing(a, b, rank, min_compression_rate)
            if compress:
                matrices.append(MatrixBlock(entry.key, entry.offset, entry.size, a, b, r))
                continue
        add_dense(entry.offset, entry.offset + entry.size)
    return Plan(n, tuple(matrices), tuple(dense), padded=False)
