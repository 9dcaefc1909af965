"""One bucket's exchange inside a traced TensorFlow step, and its parts written back by TF ops.

A bucket is the gradients Horovod hands the compressor at once: one gradient by default,
a whole group under ``DistributedGradientTape(..., groups=...)``. Its exchange is one host
call in the traced step:

1. the gradients go in as they are, flattened (no fused copy: the pipeline's memory reads
   them in place). On the CPU the call is a ``tf.numpy_function`` and the pipeline runs
   numpy's kernels on zero-copy views, as the PyTorch frontend does on CPU tensors; on a
   GPU (or with ``on_device=True``) it is a ``tf.py_function`` and the pipeline runs
   TensorFlow's own ops on the gradients' device, and only its payload crosses to numpy
   for mpi4py (:mod:`horovod_sparse.ops.host` counts it);
2. out comes each gradient's part of the sum: a sparsifier's ``(indices, values)`` pairs
   (O(k), never the dense gradient), or a dense part for the other pipelines. TensorFlow
   keeps a returned array without copying it, so ``exchange`` must return buffers it will not
   write again (a pipeline's reused result buffer is copied first);
3. TensorFlow ops scale the part by the reduced probe and scatter it into a tensor of the
   gradient's shape and dtype (:meth:`BucketPart.to_gradient`).

Every rank must enter the exchanges in the same order, but TensorFlow may run independent
ops in any order: inside ``tf.function`` each exchange reads a shared token variable before
it runs and increments it after (automatic control dependencies then serialise them); in a
plain TF1-style graph each takes an input from the previous one's ``tf.cond``
(:class:`~horovod_sparse.tensorflow.graph_mode.GraphExchangeChain`).

Example::

    def exchange(pieces):                    # numpy (or TF tensors on a device), one per gradient
        indices, values = pipeline.step_sparse(pieces, tag=layout.tag)
        return sparse_parts(layout, indices, values)
    parts = InOrderHostExchanges().run(exchange, [(key, grad)], layout, sparse=True)
    averaged = parts[key].to_gradient(scale=probe[0] / P)
"""
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from horovod_sparse.layout import sparse_bounds
from horovod_sparse.ops.namespace import copy_of
from horovod_sparse.tensorflow.graph_mode import GraphExchangeChain, in_graph_mode


@dataclass
class BucketPart:
    """One gradient's part of its bucket's float32 sum, as the host call returned it."""

    shape: tuple
    dtype: tf.DType
    size: int
    values: tf.Tensor              # float32: the dense part (``size`` values), or the sparse values
    indices: tf.Tensor = None      # int64 indices into the gradient, for a sparse part

    def to_gradient(self, scale):
        """The part times ``scale`` (a scalar tensor), as a tensor of the gradient's shape and
        dtype: sparse values are scaled (O(k)) and scattered into zeros."""
        if self.indices is None:
            summed = self.values * scale
        else:
            summed = tf.scatter_nd(self.indices[:, None], self.values * scale, [self.size])
        return tf.cast(tf.reshape(summed, self.shape), self.dtype)


def sparse_parts(layout, indices, values):
    """Split a sparsifier's sum over a fused buffer (sorted ``indices`` into ``layout``'s buffer
    and their ``values``) by gradient: ``[(indices into the gradient, values)]`` in layout order,
    new arrays (the exchange may reuse its result buffers)."""
    bounds = sparse_bounds(layout, indices)
    return [(indices[lo:hi] - entry.offset, copy_of(values[lo:hi]))
            for entry, (lo, hi) in zip(layout.entries, bounds)]


def dense_parts(layout, summed):
    """Split a dense sum over a fused buffer by gradient, in layout order."""
    return [summed[e.offset:e.offset + e.size] for e in layout.entries]


def nonfinite_parts(layout, sparse):
    """Every gradient's part of a step whose gradient overflowed on some rank
    (:mod:`horovod_sparse.nonfinite`): NaN everywhere, as :func:`sparse_parts` (every index)
    or :func:`dense_parts` give it, so that the loss scaler skips the step."""
    nan = [np.full(e.size, np.nan, np.float32) for e in layout.entries]
    if sparse:
        return [(np.arange(e.size, dtype=np.int64), values) for e, values in zip(layout.entries, nan)]
    return nan


class InOrderHostExchanges:
    """Host calls, one per bucket, run in trace order on every rank (module docstring)."""

    def __init__(self):
        self._token = None                  # orders the exchanges inside tf.function
        self._chain = GraphExchangeChain()  # orders them in a plain (TF1-style) graph

    def run(self, exchange, recorded, layout, sparse=False, on_device=False, ready=None, carried=None):
        """Trace one exchange of the gradients ``recorded`` (``[(key, tensor)]``, laid out by
        ``layout``). ``exchange(pieces)`` gets one flat piece per gradient (numpy arrays, or TF
        tensors with ``on_device``) and returns each gradient's part of the sum, in layout order:
        ``(indices, values)`` with ``sparse``, else a float32 array of the gradient's size.
        With ``ready`` (tensors), the call takes those instead of the gradients, and
        ``exchange`` gets None: the gradients went to the exchange by other calls
        (:mod:`~horovod_sparse.tensorflow.planned_step`). With ``carried`` (the step's gradients
        that Horovod carries as they are), it is ``exchange(pieces, finite)``: whether they are
        all finite on this rank (an overflow there skips the exchange too). Returns
        ``{key: BucketPart}``."""
        pieces = [tf.reshape(g, [-1]) for _, g in recorded] if ready is None else list(ready)
        count = len(recorded)
        if carried is not None:  # one bool after the pieces
            pieces.append(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in carried] or [True]))
        kinds = [tf.int64, tf.float32] if sparse else [tf.float32]

        def call(*args):  # the pieces (or what the call waits for), then what orders the call
            given = list(args[:count]) if ready is None else None
            parts = exchange(given) if carried is None else exchange(given, bool(args[count]))
            flat = []
            for part in parts:
                flat.extend(part if sparse else (part,))
            if on_device:
                return flat
            return [np.asarray(a, dtype=kind.as_numpy_dtype) for a, kind in zip(flat, kinds * count)]

        host_call = tf.py_function if on_device else _numpy_function
        if in_graph_mode():  # no automatic control dependencies: chain the tf.conds by hand
            outputs = host_call(call, [*pieces, *self._chain.after_previous()], kinds * count)
            self._chain.traced(outputs[0])
        else:
            token = self._token_variable()
            outputs = host_call(call, [*pieces, token.read_value()], kinds * count)
            with tf.control_dependencies(outputs):
                token.assign_add(1)
        results = {}
        for i, (entry, (key, g)) in enumerate(zip(layout.entries, recorded)):
            if sparse:
                indices, values = outputs[2 * i], outputs[2 * i + 1]
                indices.set_shape([None])
                values.set_shape([None])
            else:
                indices, values = None, outputs[i]
                values.set_shape([entry.size])
            results[key] = BucketPart(entry.shape, g.dtype, entry.size, values, indices)
        return results

    def _token_variable(self):
        if self._token is None:
            with tf.init_scope():
                self._token = tf.Variable(0, dtype=tf.int64, trainable=False, name="exchange_token")
        return self._token


def _numpy_function(func, inp, Tout):
    return tf.numpy_function(func, inp, Tout, stateful=True)
