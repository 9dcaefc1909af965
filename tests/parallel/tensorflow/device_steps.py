"""What the tests of the pipelines as TensorFlow ops share (``test_device_ops*.py``): given
gradients, step by step, through ``hvd.DistributedGradientTape`` in a ``tf.function``, on numpy
or as TensorFlow ops (``compression.on_device``), with the host traffic of each step counted."""
import math

import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

import horovod_sparse
import horovod_sparse.tensorflow as hvds
from horovod_sparse.layout import GradientLayout
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


def oracle_averages(spec, comm, targets, shapes, dense_below=64):
    """Per step, ``{index: averaged gradient}`` of the gradients of ``shapes`` with at least
    ``dense_below`` elements: an independent numpy pipeline of ``spec`` over them fused, in
    their order (what the compressor's one exchange of the step must give)."""
    large = [i for i, s in enumerate(shapes) if math.prod(s) >= dense_below]
    layout = GradientLayout([(i, shapes[i], "float32") for i in large])
    with horovod_sparse.create(spec).make_pipeline(layout.n, comm, layout=layout) as oracle:
        return [dict(zip(large, layout.split(oracle.step(layout.fuse([ts[j] for j in large]), tag=layout.tag)
                                             / np.float32(comm.size))))
                for ts in targets]
