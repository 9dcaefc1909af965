"""What the tests of the pipelines as TensorFlow ops share (``test_device_ops*.py``): given
gradients, step by step, through ``hvd.DistributedGradientTape`` in a ``tf.function``, on numpy
or as TensorFlow ops (``compression.on_device``), with the host traffic of each step counted."""
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.ops.host import HOST_TRAFFIC


def tape_step(compression, variables):
    """A traced step whose loss is sum(v * t): each variable's gradient is its target ``t``."""
    @tf.function
    def step(targets):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)
    return step


def run_gradients(spec, on_device, targets, shapes, dense_below=64, per_step=None):
    """``targets`` (per step, one array per shape) as the gradients of variables of ``shapes``;
    returns the compression and each step's averaged gradients. ``HOST_TRAFFIC`` is reset
    before each step, and ``per_step(i, compression)`` called after it."""
    compression = hvds.Compression.from_spec(spec, dense_below=dense_below)
    compression.on_device = on_device
    step = tape_step(compression, [tf.Variable(tf.zeros(s)) for s in shapes])
    results = []
    for i, ts in enumerate(targets):
        HOST_TRAFFIC.reset()
        results.append([g.numpy() for g in step([tf.constant(t) for t in ts])])
        if per_step is not None:
            per_step(i, compression)
    return compression, results


def random_targets(seed, shapes, steps):
    """Standard normal gradients of ``shapes`` for ``steps`` steps, different on every rank."""
    rng = np.random.default_rng(seed + 1000 * hvd.rank())
    return [[rng.standard_normal(s).astype(np.float32) for s in shapes] for _ in range(steps)]
