"""Magnitude keys: ``|x|`` as integers with the same order, and the k-th largest of them.

A float's bits with the sign cleared, read as an integer, are ordered like the float's
magnitude: +inf lies above every finite value and NaN above +inf, so NaN counts as the
largest. Comparisons of keys are exact integer comparisons: no rounding can make two
runs, or numpy and torch, CPU or CUDA, select different entries. This is the one
definition of a key: the sparsifiers' selection (int32 keys, numpy or torch), the FFT's
and Ok-Topk's global threshold (:mod:`horovod_sparse.exchange.sparse_ops`, unsigned
keys of float32 or float64 values) all read it.

Example::

    keys = magnitude_keys(acc, out=scratch)     # int32, ordered like |acc|, NaN largest
    picked = flatnonzero(keys >= key_of(0.5))   # the entries with |acc| >= 0.5
    magnitude_of(kth_largest(keys, 10))         # the 10th largest |acc|, a float
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import backend, is_tensorflow, itemsize
from horovod_sparse.ops.views import int_view, numpy_view

#: the sign bit cleared, by the float's size in bytes
_SIGN_CLEAR = {4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}


def magnitude_keys(x, out=None):
    """Keys ordered like ``|x|`` for float32 (int32 keys) or float64 (int64 keys) ``x``,
    numpy or torch; ``out`` (an integer buffer of the same length) avoids an allocation
    (TensorFlow: a new tensor, ``out`` is ignored)."""
    if is_tensorflow(x):
        tf = sys.modules["tensorflow"]
        bits = tf.bitcast(x, tf.int32 if itemsize(x) == 4 else tf.int64)
        return tf.bitwise.bitwise_and(bits, tf.constant(_SIGN_CLEAR[itemsize(x)], bits.dtype))
    return backend(x).bitwise_and(int_view(x), _SIGN_CLEAR[itemsize(x)], out=out)


def key_of(magnitude, dtype="float32"):
    """The key (a Python int) of ``|magnitude|`` rounded to ``dtype``: IEEE rounding to
    nearest, so beyond the largest finite value it is +inf's key."""
    with np.errstate(over="ignore"):
        rounded = np.array([abs(float(magnitude))], dtype=dtype)
    return int(magnitude_keys(rounded)[0])


def magnitude_of(key, dtype="float32"):
    """Inverse of :func:`key_of`: the magnitude (a Python float) whose ``dtype`` key is ``key``."""
    size = np.dtype(dtype).itemsize
    return float(np.array([int(key) & _SIGN_CLEAR[size]], dtype=f"int{8 * size}").view(dtype)[0])


def kth_largest(x, k):
    """The ``k``-th largest entry (1 <= k <= size) of a 1-D integer array, as a Python int."""
    n = x.shape[0]
    if is_tensorflow(x):
        return int(sys.modules["tensorflow"].math.top_k(x, k).values[k - 1])
    view = numpy_view(x)
    if view is not None:
        return int(np.partition(view, n - k)[n - k])
    return int(kth_largest_on_device(x, k))


def kth_largest_on_device(x, k):
    """:func:`kth_largest` of a torch tensor as a 0-d tensor on its device: not read back."""
    return sys.modules["torch"].kthvalue(x, x.shape[0] - k + 1).values


def smallest(x):
    """The smallest entry of a non-empty 1-D integer array, as a Python int."""
    if is_tensorflow(x):
        return int(sys.modules["tensorflow"].reduce_min(x))
    return int(x.min())


def kth_largests(x, ks):
    """Like :func:`kth_largest` for several ``ks`` (Python ints, in the order of ``ks``): one
    partition per k. numpy's partition at one position is its vectorised select; at several it
    falls back to a plain introselect, 6x slower than two single ones (375,000 int32 keys: 3.4
    against 0.5 ms, ``studies/time_indexed.py``)."""
    return [kth_largest(x, k) for k in ks]
