"""The TensorFlow out-of-band compressor: exchanges Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT), chained in trace order.

Horovod's TensorFlow frontend calls ``compress`` for a gradient, allreduces its payload,
then calls ``decompress``. By default it does this one gradient at a time (each inside
its own ``tf.cond``); with ``DistributedGradientTape(..., groups=1)`` (or ``num_groups``)
it compresses a whole group first. So ``compress`` records the gradient and returns a
one-element probe, and the first ``decompress`` that needs a result runs one exchange
over everything recorded so far: one gradient by default, the whole group — fused, as
in the PyTorch frontend — when grouped.

Each exchange runs in ``tf.numpy_function``. TensorFlow may run independent ops in any
order, but every rank must enter the collectives in the same order, so each exchange
reads a shared token variable before it runs and increments it after: automatic control
dependencies then serialise the exchanges (and the ``tf.cond``s holding them) in trace
order on every rank.
"""
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor
from horovod.tensorflow.mpi_ops import Adasum

from horovod_sparse.horovod_checks import check_caller
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.sparse_adapter import SparseCompressorBase
from horovod_sparse.tensorflow.positions import TracePositions


class TFOutOfBandCompressor(SparseCompressorBase, HorovodCompressor):
    """A real ``horovod.tensorflow.compression.Compressor`` running fused pipelines out of band.

    Args:
        algorithm: a fused compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.

    Gradients are identified as in :class:`~horovod_sparse.tensorflow.TFCompressor` (position
    in the traced function; ``compress(tensor, name=...)`` when called eagerly). Each set of
    gradients exchanged together (one gradient, or one Horovod group) has its own sparsifier.
    """

    ops = TFOps()

    def __init__(self, algorithm, dense_below=None):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self._positions = TracePositions()
        self._token = None
        self._recorded = []  # (key, gradient) compressed but not yet exchanged
        self._results = {}   # key -> (summed gradient tensor, shape, dtype)

    def compress(self, tensor, name=None):
        check_caller(self.algorithm.name, Adasum)
        key = name if name is not None else self._positions.next(self.algorithm)
        if self.goes_dense(tensor):
            return self.compress_dense(tensor, key)
        self._recorded.append((key, tensor))
        probe = tf.ones([1], tf.float32)
        self.record(key, tensor, probe)
        return probe, ("sparse", key)

    def decompress(self, tensor, ctx):
        kind, info = ctx
        if kind == "dense":
            return self.decompress_dense(tensor, info)
        if info not in self._results:
            self._exchange_recorded()
        summed, shape, dtype = self._results.pop(info)
        scaled = summed * (tensor[0] / tf.cast(self.comm.Get_size(), tf.float32))
        return tf.cast(tf.reshape(scaled, shape), dtype)

    def _exchange_recorded(self):
        recorded, self._recorded = self._recorded, []
        layout = GradientLayout([(key, self.ops.shape(g), self.ops.dtype_name(g)) for key, g in recorded])
        sparsifier = self.sparsifier_for(tuple(key for key, _ in recorded), layout)
        token = self._token_variable()
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for _, g in recorded], axis=0)
        summed = tf.numpy_function(lambda buffer, _: sparsifier.step(buffer, tag=layout.tag),
                                   [flat, token.read_value()], tf.float32, stateful=True)
        summed.set_shape([layout.n])
        with tf.control_dependencies([summed]):
            token.assign_add(1)
        for entry, (key, g) in zip(layout.entries, recorded):
            self._results[key] = (summed[entry.offset:entry.offset + entry.size], entry.shape, g.dtype)

    def _token_variable(self):
        if self._token is None:
            with tf.init_scope():
                self._token = tf.Variable(0, dtype=tf.int64, trainable=False, name="exchange_token")
        return self._token


#: the name it had when only sparsifiers used it
TFSparseCompressor = TFOutOfBandCompressor
