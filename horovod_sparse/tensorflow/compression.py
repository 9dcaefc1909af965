"""The TensorFlow Horovod compressor: one framework-free compressor bound to TF ops."""
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor

from horovod_sparse.catalogue import make_compression_namespace
from horovod_sparse.in_band import InBandCompressorBase
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.tensorflow.auto import TFAutoCompressor
from horovod_sparse.tensorflow.out_of_band import TFOutOfBandCompressor
from horovod_sparse.tensorflow.construction import refuse_inside_trace
from horovod_sparse.tensorflow.graph_mode import run_state_updates
from horovod_sparse.tensorflow.gradient_keys import GradientKeys


class TFCompressor(InBandCompressorBase, HorovodCompressor):
    """A real ``horovod.tensorflow.compression.Compressor`` running a horovod_sparse compressor.

    Horovod calls TensorFlow compressors while tracing a ``tf.function`` (also from eager
    code), once per gradient. Under ``DistributedGradientTape`` and the Keras
    ``DistributedOptimizer`` a gradient is identified by its variable's name (see
    :mod:`~horovod_sparse.tensorflow.gradient_keys`), so every trace (a retrace, a step with a
    variable whose gradient is ``None``, a step with frozen variables left out of the list)
    uses each variable's own residual; a variable that leaves keeps its residual and step
    for when it returns. Under a plain ``hvd.allreduce(g, compression=...)`` it is the
    position in the trace (counted from 0 in every trace). Called eagerly, a stateful
    compressor needs ``compress(tensor, name=...)`` to know which residual is whose.

    Use one instance per optimizer or tape, created outside the traced step (a stateful
    one created inside raises RuntimeError; stateless ones such as ``fp16`` work anywhere,
    uncalled too). ``state_dict()``/``load_state_dict()`` save and restore residuals and
    step counters, keyed by variable name.

    Example::

        compression = hvds.Compression.randomk(density=0.01)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
    """

    ops = TFOps()

    def __init__(self, algorithm):
        if algorithm.stateful:
            refuse_inside_trace(algorithm)
        super().__init__(algorithm)
        self._keys = GradientKeys()

    # A walk over Python frames, run once at trace time: autograph must not rewrite its loop.
    agree_across_ranks = tf.autograph.experimental.do_not_convert(InBandCompressorBase.agree_across_ranks)

    def compress(self, tensor, name=None):
        key = self._keys.of(tensor, self.algorithm, name)
        with run_state_updates() as mark:  # in a TF1-style graph the residual updates must be made to run
            payload, ctx = self.compress_slot(tensor, key)
            return mark(payload), ctx


Compression = make_compression_namespace(
    TFCompressor, TFOutOfBandCompressor,
    """Compressors for ``hvd.DistributedGradientTape(compression=...)`` and
    ``horovod.tensorflow.keras.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TFCompressor`, e.g.
    ``Compression.randomk(density=0.01)``; also ``Compression.from_spec(...)`` and
    ``Compression.available()``; ``Compression.auto()`` picks per gradient
    (:class:`~horovod_sparse.tensorflow.auto.TFAutoCompressor`).
    """, auto_cls=TFAutoCompressor)
