"""Sorted int64 indices: which entries are marked, and the entries at given indices.

Results stay in the input's library and device. On numpy and CPU tensors the
compaction and matching run numpy's kernels on zero-copy views (2-5x torch's on one
thread, :mod:`horovod_sparse.ops.views`); the results are integers, so the same bits.

Example::

    picked = compact(keys >= key)       # sorted int64 indices of the marked entries
    values = take(acc, picked)
"""
import sys

import numpy as np

from horovod_sparse.ops import cpu, kernels
from horovod_sparse.ops.cpu.cast import gather_at
from horovod_sparse.ops.cpu.sparsify import sorted_membership
from horovod_sparse.ops.host import to_list
from horovod_sparse.ops.namespace import backend, is_tensorflow, is_torch
from horovod_sparse.ops.views import as_like, numpy_view


def flatnonzero(mask):
    """int64 indices of the true entries of a 1-D bool array, sorted, same library/device."""
    if is_tensorflow(mask):
        tf = sys.modules["tensorflow"]
        return tf.reshape(tf.where(mask), [-1])
    if is_torch(mask):
        return mask.nonzero().view(-1)
    return np.flatnonzero(mask)


def compact(mask, count=None):
    """Like :func:`flatnonzero`, with numpy's kernel on a zero-copy view of a CPU tensor. ``count``:
    how many are true, if the caller knows: a torch tensor on a device is then compacted into that
    fixed size (``nonzero_static``), without reading the count back a second time."""
    view = numpy_view(mask)
    if view is None:
        if count is not None and is_torch(mask):
            return sys.modules["torch"].nonzero_static(mask, size=count).view(-1)
        return flatnonzero(mask)
    found = np.flatnonzero(view)
    return sys.modules["torch"].from_numpy(found) if is_torch(mask) else found


def count_nonzero(mask):
    """Number of true entries, as a Python int."""
    if is_tensorflow(mask):
        return int(sys.modules["tensorflow"].math.count_nonzero(mask))
    return int(backend(mask).count_nonzero(mask))


def take(x, indices):
    """``x[indices]`` for 1-D ``x`` and int64 ``indices`` (on the CPU a compiled loop,
    :func:`~horovod_sparse.ops.cpu.cast.gather_at`; else torch's index_select, ~3x faster than
    torch's indexing)."""
    if is_tensorflow(x):
        return sys.modules["tensorflow"].gather(x, indices)
    views = kernels.indexed_views(x, indices)
    if views is not None:
        out = np.empty(views[1].shape[0], views[0].dtype)
        if gather_at(*views, out):
            raise IndexError(f"an index of {x.shape[0]} entries is out of range")
        return as_like(out, x)
    return sys.modules["torch"].index_select(x, 0, indices) if is_torch(x) else x[indices]


def isin_sorted(a, b):
    """Bool mask over ``a``: which entries are in ``b`` (both 1-D, sorted, unique, same
    library/device). On the CPU a compiled merge (:func:`~horovod_sparse.ops.cpu.sparsify.sorted_membership`),
    or numpy's kernel (~3x faster than torch.isin on one thread)."""
    if is_tensorflow(a):  # b sorted: a binary search per entry of a
        tf = sys.modules["tensorflow"]
        if int(b.shape[0]) == 0:
            return tf.zeros(tf.shape(a), tf.bool)
        at = tf.minimum(tf.searchsorted(b, a), int(b.shape[0]) - 1)
        return tf.equal(tf.gather(b, at), a)
    a_view, b_view = numpy_view(a), numpy_view(b)
    if a_view is None or b_view is None:
        return sys.modules["torch"].isin(a, b, assume_unique=True)
    if cpu.enabled():  # one merge of the two sorted arrays
        found = np.empty(a_view.shape[0], np.bool_)
        sorted_membership(a_view, b_view, found)
    else:
        found = np.isin(a_view, b_view, assume_unique=True)
    return sys.modules["torch"].from_numpy(found) if is_torch(a) else found


def searchsorted(sorted_x, values):
    """``[bisect_left(sorted_x, v) for v in values]`` as Python ints: where each of ``values``
    (a list of ints) would go in the 1-D sorted ``sorted_x`` (numpy, torch or TensorFlow)."""
    view = numpy_view(sorted_x)
    if is_tensorflow(sorted_x):
        tf = sys.modules["tensorflow"]
        return [int(i) for i in tf.searchsorted(sorted_x, tf.constant(values, sorted_x.dtype)).numpy()]
    if view is None:
        torch = sys.modules["torch"]
        return to_list(torch.searchsorted(sorted_x, torch.tensor(values, dtype=sorted_x.dtype,
                                                                 device=sorted_x.device)))
    return np.searchsorted(view, np.asarray(values, dtype=view.dtype)).tolist()
