"""The TensorFlow Horovod compressor: one framework-free compressor bound to TF ops."""
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor

from horovod_sparse.adapter import CompressorAdapter, make_compression_namespace
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.tensorflow.chained import TFSparseCompressor
from horovod_sparse.tensorflow.positions import TracePositions


class TFCompressor(CompressorAdapter, HorovodCompressor):
    """A real ``horovod.tensorflow.compression.Compressor`` running a horovod_sparse compressor.

    Horovod calls TensorFlow compressors while tracing a ``tf.function`` (also from eager
    code), once per gradient in the gradient list's order. A gradient is identified by
    its position in that trace (counted in the function being traced, looking through
    the ``tf.cond`` branches Horovod wraps each allreduce in). Every trace counts from 0,
    so a retrace (``tf.function`` traces twice when its first trace creates variables,
    as the residuals are) reuses the same residual variables. Called eagerly, a stateful compressor needs
    ``compress(tensor, name=...)`` to know which residual is whose.

    Use one instance per optimizer or tape. ``state_dict()``/``load_state_dict()``
    save and restore residuals and step counters.
    """

    ops = TFOps()

    def __init__(self, algorithm):
        super().__init__(algorithm)
        self._positions = TracePositions()

    # A walk over Python frames, run once at trace time: autograph must not rewrite its loop.
    agree_across_ranks = tf.autograph.experimental.do_not_convert(CompressorAdapter.agree_across_ranks)

    def compress(self, tensor, name=None):
        return self.compress_slot(tensor, name if name is not None else self._positions.next(self.algorithm))


Compression = make_compression_namespace(
    TFCompressor, TFSparseCompressor,
    """Compressors for ``hvd.DistributedGradientTape(compression=...)`` and
    ``horovod.tensorflow.keras.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TFCompressor`, e.g.
    ``Compression.randomk(density=0.01)``; also ``Compression.from_spec(...)`` and
    ``Compression.available()``.
    """)
