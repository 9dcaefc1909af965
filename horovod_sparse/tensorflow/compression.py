"""The TensorFlow Horovod compressor: one framework-free compressor bound to TF ops."""
import weakref

import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor
from tensorflow.python.ops.control_flow_v2_func_graphs import CondBranchFuncGraph

from horovod_sparse.adapter import CompressorAdapter, make_compression_namespace
from horovod_sparse.ops.tf_ops import TFOps


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
        self._positions = weakref.WeakKeyDictionary()  # traced graph -> next position

    def compress(self, tensor, name=None):
        return self.compress_slot(tensor, name if name is not None else self._trace_position())

    def _trace_position(self):
        if tf.executing_eagerly():
            if self.algorithm.stateful:
                raise ValueError(
                    f"{self.algorithm.name} keeps per-gradient state and was called eagerly without "
                    "a name; call it inside tf.function (as hvd.DistributedGradientTape and the "
                    "Keras DistributedOptimizer do) or as compress(tensor, name=...)")
            return None
        # Horovod wraps each allreduce in tf.cond: count in the function around the branches.
        graph = tf.compat.v1.get_default_graph()
        while isinstance(graph, CondBranchFuncGraph):
            graph = graph.outer_graph
        position = self._positions.get(graph, 0)
        self._positions[graph] = position + 1
        return position


Compression = make_compression_namespace(
    TFCompressor,
    """Compressors for ``hvd.DistributedGradientTape(compression=...)`` and
    ``horovod.tensorflow.keras.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TFCompressor`, e.g.
    ``Compression.randomk(density=0.01)``; also ``Compression.from_spec(...)`` and
    ``Compression.available()``.
    """)
