"""In-place arithmetic: kernels that write into a buffer the caller gives.

A step of a pipeline is a few passes over the gradient; writing into reused buffers
instead of allocating keeps it so (a new 100 MB buffer costs its page faults, more than
the math). Each kernel picks the faster spelling of the same operation: torch's indexed
kernels (``index_fill_``, ``index_copy_``: ~2x the indexed store), or numpy's on a
zero-copy view of a CPU tensor where torch's is slower there (comparisons into bool,
float -> integer casts). The results are the same bits either way.

TensorFlow tensors (the pipelines' step as TensorFlow ops on the gradient's device) are
immutable: there the same kernels return a new tensor, so callers always use what a kernel
returns (``x = zero_at(x, indices)``), never only its ``out``.

Example::

    acc = zero_at(acc, sent)            # error feedback: what was sent leaves the residual
    mask, count = mark_at_least(keys, key, mask)
"""
import sys

import numpy as np

from horovod_sparse.ops import cpu
from horovod_sparse.ops.cpu import cast as cpu_cast
from horovod_sparse.ops.namespace import backend, host_shortcut_allowed, is_tensorflow, is_torch
from horovod_sparse.ops.views import int_view, numpy_view

#: the buffers the compiled indexed loads and stores run on (others keep the library's own):
#: values, and the indices a step gathers from its own selection
_INDEXED_DTYPES = tuple(np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64))


def zero_at(x, indices, where=None):
    """``x[indices] = 0`` in place, for 1-D ``x`` (on the CPU a compiled loop,
    :func:`~horovod_sparse.ops.cpu.cast.zero_at`; else torch's index_fill_); returns ``x``
    (TensorFlow: a new tensor). ``where`` (torch only): a bool mask over ``indices``, zero only
    those (``x[indices[where]] = 0``) without compacting them, which on a device reads their
    count back: the entries at ``indices`` are written back as they were, or 0 where ``where``."""
    if where is not None:
        torch = sys.modules["torch"]
        return x.index_copy_(0, indices, torch.where(where, 0, x.index_select(0, indices)))
    if is_tensorflow(x):
        tf = sys.modules["tensorflow"]
        return tf.tensor_scatter_nd_update(x, indices[:, None], tf.zeros(tf.shape(indices), x.dtype))
    views = indexed_views(x, indices)
    if views is not None:
        if cpu_cast.zero_at(*views):
            raise IndexError(f"an index of {x.shape[0]} entries is out of range")
        return x
    if is_torch(x):
        x.index_fill_(0, indices, 0)
    else:
        x[indices] = 0
    return x


def indexed_views(x, indices):
    """``(x, indices)`` as numpy views where the compiled indexed loads and stores serve (kernels
    on, 1-D float32, float64, int32 or int64 ``x`` on the CPU, 1-D integer ``indices``), else None."""
    if not cpu.enabled():
        return None
    x_view, i_view = numpy_view(x), numpy_view(indices)
    if x_view is None or i_view is None or x_view.ndim != 1 or i_view.ndim != 1:
        return None
    if x_view.dtype not in _INDEXED_DTYPES or i_view.dtype.kind not in "iu":
        return None
    return x_view, i_view


def put(x, indices, values):
    """``x[indices] = values`` in place, for 1-D ``x`` (torch: index_copy_)."""
    if is_torch(x):
        x.index_copy_(0, indices, values)
    else:
        x[indices] = values


def copy(x):
    """A copy of ``x`` in its library and device (torch: clone; TensorFlow tensors are immutable:
    ``x`` itself)."""
    if is_tensorflow(x):
        return x
    return x.clone() if is_torch(x) else x.copy()


def copy_into(dst, src):
    """``dst[...] = src`` (torch: copy_, which also converts the dtype)."""
    if is_torch(dst):
        dst.copy_(src)
    else:
        dst[...] = src


def cast_into(dst, src):
    """``dst[...] = src`` across dtypes (float -> int truncates toward zero; values must fit).
    CPU tensors convert through numpy on zero-copy views: torch's float32 -> uint8 kernel is
    ~3x slower here (25M: 13 vs 4.6 ms)."""
    if is_torch(dst) and is_torch(src) and host_shortcut_allowed(dst) and host_shortcut_allowed(src):
        np.copyto(dst.detach().numpy(), src.detach().numpy(), casting="unsafe")
    else:
        dst[...] = src
    return dst


def less_into(x, value, out):
    """``out[...] = x < value`` into the bool buffer ``out``. CPU tensors compare through numpy
    on zero-copy views: torch's comparison into bool is ~2.5x slower here (25M: 10.6 vs 4 ms)."""
    if is_torch(x) and host_shortcut_allowed(x):
        np.less(x.detach().numpy(), value, out=out.numpy())
    else:
        backend(x).less(x, value, out=out)
    return out


def set_true_at(mask, indices):
    """``mask[indices] = True`` for a 1-D bool ``mask``; returns the mask (TensorFlow: a new one)."""
    if is_tensorflow(mask):
        tf = sys.modules["tensorflow"]
        return tf.tensor_scatter_nd_update(mask, indices[:, None], tf.ones(tf.shape(indices), tf.bool))
    if is_torch(mask):
        return mask.index_fill_(0, indices, True)
    mask[indices] = True
    return mask


def mark_at_least(keys, key, out):
    """``(mask, count)``: ``keys >= key`` written into the bool buffer ``out`` (like ``keys``; a new
    tensor on TensorFlow, where ``out`` may be None) and how many are true."""
    if is_tensorflow(keys):
        tf = sys.modules["tensorflow"]
        mask = tf.greater_equal(keys, tf.constant(key, keys.dtype))
        return mask, int(tf.math.count_nonzero(mask))
    return out, count_at_least(keys, key, out)


def count_at_least(keys, key, out):
    """Write ``keys >= key`` into the bool buffer ``out`` (like ``keys``); return how many are true."""
    view = numpy_view(keys)
    if view is not None:
        return int(np.count_nonzero(np.greater_equal(view, key, out=numpy_view(out))))
    return int(sys.modules["torch"].ge(keys, key, out=out).sum())


def bfloat16_bits(x, out):
    """Write the int16 bits of float32 ``x`` rounded to bfloat16 (nearest, ties to even) into
    ``out`` (int16, same length); a NaN gives some NaN code (torch's cast), callers fix NaNs.
    TensorFlow: numpy's integer rounding, into a new int16 tensor (``out`` unused)."""
    if is_tensorflow(x):
        tf = sys.modules["tensorflow"]
        bits = tf.bitcast(x, tf.int32)
        rounded = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 16), 1) + bits + 0x7FFF
        return tf.cast(tf.bitwise.right_shift(rounded, 16), tf.int16)
    if is_torch(x):
        return out.view(sys.modules["torch"].bfloat16).copy_(x)
    bits = int_view(x)  # bits + 0x7FFF + (bit 16), then the top half: wraps only for NaNs
    rounded = np.right_shift(bits, 16)
    rounded &= 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    return out
