"""PowerSGD's matrix products on one block of a flat buffer, in the buffer's own library
(numpy, or torch on any device), without copying the block; or TensorFlow, whose
tensors are immutable: there each kernel returns a new tensor and ignores its ``out``
buffer (the callers always use what a kernel returns).

A :class:`~.plan.MatrixBlock` is ``rows x cols`` elements of the buffer read row-major.
With a layout the block is exactly one gradient. Without one (the whole buffer as one
near-square matrix) the last data row may be short and the rows after it are zero
padding: :class:`BlockView` never materialises them, it splits the block into ``head``
(the full rows, a ``(full, cols)`` view), ``tail`` (the short row's elements, maybe none)
and implicit zero rows.

* :func:`project` (P = M Q) and :func:`back_project` (Q = M^T P) are BLAS products in
  float32: each rank's own, summed by MPI afterwards, so their rounding needs no agreement.
* :func:`expand` (M ~ P Q^T) writes what every rank must hold bit for bit. It is r
  element-wise products added in column order, never a BLAS reduction (whose split
  could depend on thread counts or the library): the same bits in numpy and torch,
  whatever the chunking. :func:`expand_block` walks a block in chunks of rows that stay
  in cache, writing the product, or subtracting it (the residual, without a
  block-sized temporary).

On TensorFlow (eager, inside the frontend's ``tf.py_function``) :func:`project` and
:func:`back_project` are ``tf.matmul`` (its own kernels: not numpy's BLAS bits), and
:func:`expand` the same element-wise multiplies and adds in the same order as numpy (eager
ops are never fused into FMAs), so given the same factors it gives numpy's bits; it does a
block at once, as on a GPU. The kernels tell TensorFlow by ``lib is None`` (:func:`library`),
decided once per step: an ``is_tensorflow`` per call would cost the numpy path ~2 us a matrix.
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import backend, is_tensorflow


class BlockView:
    """A block of ``flat`` (1-D) as ``head`` (full rows, a view), ``tail`` (a short last
    row, possibly empty, a view) and zero rows up to ``rows``; ``values`` is the block's
    elements, 1-D. ``flat`` None: the shape only (no values, head or tail), for a
    TensorFlow result that is assembled from new tensors."""

    def __init__(self, flat, block):
        self.rows, self.cols, self.rank = block.rows, block.cols, block.rank
        self.full = block.size // block.cols
        self.tail_size = block.size - self.full * block.cols
        self._flat, self._block = flat, block
        self.head = self.tail = None
        if flat is not None:
            head_end = block.offset + self.full * block.cols
            self.head = _reshaped(flat[block.offset:head_end], (self.full, block.cols))
            self.tail = flat[head_end:block.offset + block.size]

    @property
    def values(self):
        return self._flat[self._block.offset:self._block.offset + self._block.size]


def library(x):
    """The library whose in-place (``out=``) kernels run on ``x``: numpy or torch; None for a
    TensorFlow tensor or no buffer (TensorFlow: the kernels here branch on the factors)."""
    return None if x is None or is_tensorflow(x) else backend(x)


def _reshaped(x, shape):
    if not isinstance(x, np.ndarray) and is_tensorflow(x):
        return sys.modules["tensorflow"].reshape(x, shape)
    return x.reshape(shape)


def project(lib, m, q, p):
    """p = M q: ``m`` a :class:`BlockView`, ``q`` (cols, r), ``p`` (rows, r) written in place
    (zero rows for the padding); returns ``p`` (TensorFlow, ``lib`` None: a new tensor, ``p`` unused)."""
    if lib is None:
        tf = sys.modules["tensorflow"]
        parts = [tf.matmul(m.head, q)] if m.full else []
        if m.tail_size:
            parts.append(tf.matmul(m.tail[None, :], q[:m.tail_size]))
        padding = m.rows - m.full - (1 if m.tail_size else 0)
        if padding:
            parts.append(tf.zeros([padding, q.shape[1]], q.dtype))
        return tf.concat(parts, 0)
    if m.full:
        lib.matmul(m.head, q, out=p[:m.full])
    below = m.full
    if m.tail_size:
        p[m.full] = lib.matmul(m.tail, q[:m.tail_size])
        below += 1
    if below < m.rows:
        p[below:] = 0
    return p


def back_project(lib, m, p, q):
    """q = M^T p: ``m`` a :class:`BlockView`, ``p`` (rows, r), ``q`` (cols, r) written in place;
    returns ``q`` (TensorFlow, ``lib`` None: a new tensor, ``q`` unused)."""
    if lib is None:
        tf = sys.modules["tensorflow"]
        if m.full:
            q = tf.matmul(m.head, p[:m.full], transpose_a=True)
        else:
            q = tf.zeros([m.cols, p.shape[1]], p.dtype)
        if m.tail_size:  # the short row: the same multiply and add as numpy's in-place +=
            q = tf.concat([q[:m.tail_size] + m.tail[:, None] * p[m.full], q[m.tail_size:]], 0)
        return q
    if m.full:
        lib.matmul(m.head.T, p[:m.full], out=q)
    else:
        q[...] = 0
    if m.tail_size:
        q[:m.tail_size] += m.tail[:, None] * p[m.full]
    return q


def expand(lib, p_t, q_t, out, tmp):
    """out = p q^T as sum over j of the outer products p[:, j] q[:, j]^T, in order of j,
    element-wise. The factors come transposed and contiguous, ``p_t`` (r, h) and ``q_t``
    (r, w), so each product broadcasts a contiguous row (strided columns make torch's CPU
    kernel 4x slower); ``out`` and ``tmp`` (h, w), tmp only used if r > 1. Returns ``out``
    (TensorFlow, ``lib`` None: a new tensor, ``out`` and ``tmp`` unused)."""
    if lib is None:
        out = p_t[0][:, None] * q_t[0]
        for j in range(1, p_t.shape[0]):
            out = out + p_t[j][:, None] * q_t[j]
        return out
    lib.multiply(p_t[0][:, None], q_t[0], out=out)
    for j in range(1, p_t.shape[0]):
        lib.multiply(p_t[j][:, None], q_t[j], out=tmp)
        lib.add(out, tmp, out=out)
    return out


def expand_block(lib, target, p_t, q_t, scratch, chunk_elements, subtract=False):
    """``target`` (a :class:`BlockView` of the output buffer) = p q^T, or ``-=`` with
    ``subtract``, on the data rows only (head, then the tail row). ``p_t`` (r, rows) and
    ``q_t`` (r, cols): the factors transposed, contiguous (:func:`transposed`).

    scratch : two 1-D buffers in ``lib`` of at least ``rows_per_chunk * cols`` elements,
        rows_per_chunk = max(1, chunk_elements // cols) (see :func:`scratch_elements`).

    Returns None: the block is written in place. TensorFlow (``lib`` None): writes nothing,
    returns the block's new values, 1-D (``target`` is read with ``subtract`` only, and may
    be a shape-only view otherwise; no scratch, no chunks).
    """
    if lib is None:
        tf = sys.modules["tensorflow"]
        full, tail = target.full, target.tail_size
        values = [tf.reshape(expand(None, p_t[:, :full], q_t, None, None), [-1])]
        if tail:
            values.append(tf.reshape(expand(None, p_t[:, full:full + 1], q_t[:, :tail], None, None), [-1]))
        values = tf.concat(values, 0)
        if subtract:
            values = target.values - values
        return values
    cols = target.cols
    step = max(1, chunk_elements // cols)
    groups = [(target.head[i:i + step], p_t[:, i:min(i + step, target.full)], q_t)
              for i in range(0, target.full, step)]
    if target.tail_size:
        groups.append((target.tail.reshape(1, target.tail_size), p_t[:, target.full:target.full + 1],
                       q_t[:, :target.tail_size]))
    for rows, p_rows, q_cols in groups:
        size = rows.shape[0] * rows.shape[1]
        tmp = scratch[1][:size].reshape(rows.shape)
        if not subtract:
            expand(lib, p_rows, q_cols, rows, tmp)
            continue
        product = scratch[0][:size].reshape(rows.shape)
        expand(lib, p_rows, q_cols, product, tmp)
        lib.subtract(rows, product, out=rows)


def transposed(x):
    """``x.T`` as a new contiguous array (numpy or torch, or a TensorFlow tensor): the small
    factors, for :func:`expand`."""
    if hasattr(x, "contiguous"):
        return x.T.contiguous()
    return x.T.copy() if isinstance(x, np.ndarray) else sys.modules["tensorflow"].transpose(x)


def scratch_elements(blocks, chunk_elements):
    """Elements each of :func:`expand_block`'s two scratch buffers needs for ``blocks``."""
    return max([min(b.rows, max(1, chunk_elements // b.cols)) * b.cols for b in blocks] or [0])
