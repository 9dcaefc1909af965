"""Is a buffer finite? The overflow check of every stateful step.

A loss scaler (``torch.amp.GradScaler``, TensorFlow's ``LossScaleOptimizer``) overflows by
design: a step's gradients come out inf or NaN, the scaler skips that step and lowers the
scale. A compressor that took such a gradient into its residual (or momentum, or warm-start
factors) would send it back every later step, so each pipeline checks what it is about to
compress before its state changes (:mod:`horovod_sparse.nonfinite`).

The check is one reduction, not a mask: the sum of a buffer is finite only if every element
is (an inf or a NaN makes the sum inf or NaN); a non-finite sum of finite elements (an
overflow of the float32 sum itself, values near 3e38) is told apart by the exact check,
which then runs once. numpy's float32 sum reads the buffer at about 1.6x the speed of a
memory copy of it here (25M elements: 20 ms against 33 ms).

Example::

    all_finite(np.array([1.0, np.inf], np.float32))   # False
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import is_tensorflow
from horovod_sparse.ops.views import numpy_view


def all_finite(x):
    """True if every element of the 1-D float buffer ``x`` (numpy, torch on any device, or an
    eager TensorFlow tensor) is finite; an empty buffer is. Reads ``x`` once (on a GPU, a
    synchronisation: the answer goes into the exchange's header)."""
    view = numpy_view(x)
    if view is not None:
        return bool(np.isfinite(np.sum(view))) or bool(np.isfinite(view).all())
    if is_tensorflow(x):
        tf = sys.modules["tensorflow"]
        return bool(tf.math.is_finite(tf.reduce_sum(x))) or bool(tf.reduce_all(tf.math.is_finite(x)))
    torch = sys.modules["torch"]
    return bool(torch.isfinite(x.sum())) or bool(torch.isfinite(x).all())
