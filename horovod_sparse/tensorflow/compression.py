"""The TensorFlow Horovod compressor: one framework-free compressor bound to TF ops."""
import contextlib
import weakref

import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor

from horovod_sparse.catalogue import make_compression_namespace
from horovod_sparse.in_band import InBandCompressorBase
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.tensorflow.auto import TFAutoCompressor
from horovod_sparse.tensorflow.out_of_band import TFOutOfBandCompressor
from horovod_sparse.tensorflow.construction import refuse_inside_trace
from horovod_sparse.tensorflow.graph_mode import outermost_graph, run_state_updates
from horovod_sparse.tensorflow.gradient_keys import GradientKeys, horovod_gradients


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

    A loss scaler's overflow (``tf.keras.mixed_precision.LossScaleOptimizer``: some rank's
    gradient holds inf or NaN) gives that gradient a NaN result on every rank, so the optimizer
    skips the step on every rank, and the step leaves ``randomk``'s residuals and step counters
    (``tf.Variable``s) as they were: each gradient commits under a ``tf.cond`` on its reduced
    payload, and the next step's settle, traced before Horovod's per-gradient ``tf.cond``s,
    rolls the step's commits back if any gradient of it overflowed (:mod:`horovod_sparse.slots`;
    under ``DistributedGradientTape`` and the Keras ``DistributedOptimizer``, where the step's
    gradient list is in sight; under a plain ``hvd.allreduce``, the gradients whose state
    existed when the step was traced). ``nonfinite="raise"`` makes the step fail instead, on every
    rank, with TensorFlow's ``InvalidArgumentError`` carrying
    :class:`~horovod_sparse.exchange.NonFiniteGradientError`'s message (eagerly, that error
    itself); see :mod:`horovod_sparse.nonfinite`.

    Example::

        compression = hvds.Compression.randomk(density=0.01)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
    """

    ops = TFOps()

    def __init__(self, algorithm, nonfinite="propagate"):
        if algorithm.stateful:
            refuse_inside_trace(algorithm)
        super().__init__(algorithm, nonfinite)
        self._keys = GradientKeys()
        self._settled = weakref.WeakKeyDictionary()  # traced graph -> its step's settle (horovod_sparse.slots)

    # AutoGraph converts Horovod's step and would convert every function of ours it calls: frame
    # walks and collectives on a private communicator it must not rewrite, and over a second of
    # parsing a trace. Ours trace as they are written, as in a TF1-style graph.
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor, name=None):
        key = self._keys.of(tensor, self.algorithm, name)
        with run_state_updates() as mark:  # in a TF1-style graph the state's reads must run before its updates
            with self._after_settle(tensor):
                payload, ctx = self.compress_slot(tensor, key)
            return mark(payload), ctx

    def settles_eagerly(self):
        return tf.executing_eagerly()

    @contextlib.contextmanager
    def _after_settle(self, tensor):
        """Within it, ops wait for the settle of the previous step, traced once per graph (at its
        first ``compress``) in the graph around Horovod's per-gradient ``tf.cond``s; eagerly the
        settle runs in :meth:`compress_slot`."""
        if self.settles_eagerly() or not self.algorithm.stateful:
            yield
            return
        graph = outermost_graph()
        if graph not in self._settled:
            self._make_step_slots(tensor)
            with graph.as_default():
                self._settled[graph] = self.ops.settle([s for s in self.state.slots.values() if s.residual is not None])
        # a data input (captured into the tf.cond), not a control input: in a TF1 graph the
        # ops of a lowered tf.cond's branch do not wait for the cond's control inputs
        with tf.control_dependencies([tf.identity(self._settled[graph])]):
            yield

    def _make_step_slots(self, tensor):
        """Make now the slots of every gradient of the step (from Horovod's gradient list), so that
        the settle traced before them covers them all, at every later run of the graph. Under a
        plain ``hvd.allreduce`` (no list in sight) it covers the slots made so far."""
        for key, gradient in horovod_gradients(tensor) or ():
            if isinstance(gradient, tf.Tensor) and gradient.shape.is_fully_defined():
                self.slot_for(gradient, key)

    @tf.autograph.experimental.do_not_convert  # as compress
    def decompress(self, tensor, ctx):
        with run_state_updates() as mark:  # in a TF1-style graph the commit must be made to run
            return mark(super().decompress(tensor, ctx))


Compression = make_compression_namespace(
    TFCompressor, TFOutOfBandCompressor,
    """Compressors for ``hvd.DistributedGradientTape(compression=...)`` and
    ``horovod.tensorflow.keras.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TFCompressor`, e.g.
    ``Compression.randomk(density=0.01)``; also ``Compression.from_spec(...)`` and
    ``Compression.available()``; ``Compression.auto()`` picks per gradient
    (:class:`~horovod_sparse.tensorflow.auto.TFAutoCompressor`).
    """, auto_cls=TFAutoCompressor)
