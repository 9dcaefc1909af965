"""The step runtime's view of the arrays inside TensorFlow's host calls, and each bucket's
result split by gradient.

Under a planned schedule (:mod:`horovod_sparse.tensorflow.planned_step`) TensorFlow hands
each gradient to the runtime in its own host call: as a numpy array (a zero-copy view, on
the CPU) or, on a device, as an eager TensorFlow tensor. The runtime's
:class:`~horovod_sparse.step.bucket.Bucket` reads them through :class:`HostStepArrays`, and
its result is a :class:`StepParts`: each gradient's part of the bucket's sum, as the traced
step's collecting call returns it (a sparsifier's pairs, or a dense part).

    parts = bucket.exchange({"dense/kernel:0": g}, {}, comm, "topk")    # a StepParts
    indices, values = parts.part("dense/kernel:0")
"""
import math

import numpy as np
import tensorflow as tf

from horovod_sparse.ops.namespace import concat_float32, copy_of, is_tensorflow
from horovod_sparse.tensorflow.bucket_exchange import dense_parts, sparse_parts


class HostStepArrays:
    """numpy arrays, or eager TensorFlow tensors (module docstring)."""

    def describe(self, g):
        return tuple(int(d) for d in g.shape), g.dtype.name

    def numel(self, g):
        return math.prod(int(d) for d in g.shape)

    def flat(self, g):
        if is_tensorflow(g):
            return tf.reshape(g, [-1])
        return g.reshape(-1)

    def nonzero(self, g):
        return bool(tf.reduce_any(g != 0)) if is_tensorflow(g) else bool(np.any(g))

    def fused_buffer(self):
        return HostFusedBuffer()

    def step_sum(self, layout, gradients, summed, frozen, like):
        return StepParts(layout, summed)

    def fused_copy(self, gradients):
        return concat_float32([self.flat(g) for g in gradients])

    def copy(self, g):
        return copy_of(g)


#: the step arrays of TensorFlow's host calls
HOST_ARRAYS = HostStepArrays()


class HostFusedBuffer:
    """The gradients back to back in one float32 buffer (a new one each step: TensorFlow keeps
    what a host call returns, and a dense pipeline's result may be a view of its input)."""

    def fuse(self, layout, gradients):
        return concat_float32([HOST_ARRAYS.flat(g) for g in gradients])


class StepParts:
    """A bucket's sum split by gradient: ``part(key)`` is ``(indices into the gradient, values)``
    for a sparsifier, else the gradient's float32 slice of the dense sum; new arrays either way
    (TensorFlow keeps them without copying, and the pipeline reuses its result buffers)."""

    def __init__(self, layout, summed):
        self.sparse = isinstance(summed, tuple)
        if summed is None:  # nothing exchanged (every gradient of the bucket frozen)
            self.parts = {}
        elif self.sparse:
            self.parts = dict(zip((e.key for e in layout.entries), sparse_parts(layout, *summed)))
        else:
            self.parts = dict(zip((e.key for e in layout.entries), dense_parts(layout, copy_of(summed))))

    def part(self, key):
        return self.parts[key]
