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
order on every rank. A plain TF1-style graph has no automatic control dependencies: there
each exchange takes an input from the previous one's ``tf.cond`` instead
(:mod:`~horovod_sparse.tensorflow.graph_mode`), and no token variable is made.

Gradients are keyed by their variable's name (:mod:`~horovod_sparse.tensorflow.gradient_keys`),
so each exchange's pipeline, and its residual, belongs to its variable: a step where a
variable has no gradient or is left out of the list (frozen) skips it, and its pipeline
waits unchanged for its return. Under ``groups=`` a pipeline belongs to the group as it is
exchanged (the tuple of its variables' names): when a variable drops out of a group, the
rest form a new group with a fresh residual, and the full group's pipeline is kept for
when the full group returns.
"""
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor
from horovod.tensorflow.mpi_ops import Adasum

from horovod_sparse.agreement import check_same_on_every_rank, communicator_of
from horovod_sparse.horovod_frames import check_caller
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.out_of_band import OutOfBandCompressorBase
from horovod_sparse.tensorflow.construction import refuse_inside_trace
from horovod_sparse.tensorflow.graph_mode import GraphExchangeChain, in_graph_mode
from horovod_sparse.tensorflow.gradient_keys import GradientKeys


class TFOutOfBandCompressor(OutOfBandCompressorBase, HorovodCompressor):
    """A real ``horovod.tensorflow.compression.Compressor`` running out-of-band pipelines out of band.

    Args:
        algorithm: an out-of-band compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.

    Gradients are identified as in :class:`~horovod_sparse.tensorflow.TFCompressor` (variable
    name under Horovod's gradient allreduce, else position in the traced function;
    ``compress(tensor, name=...)`` when called eagerly). Each set of gradients exchanged
    together (one gradient, or one Horovod group) has its own sparsifier. Create it outside
    the traced step (inside, it raises RuntimeError); at its first ``compress`` every rank
    checks that all passed the same compressor and parameters (ValueError on every rank).

    Example::

        compression = hvds.Compression.topk(density=0.01)   # TFOutOfBandCompressor
        tape = hvd.DistributedGradientTape(tape, compression=compression)
    """

    ops = TFOps()

    def __init__(self, algorithm, dense_below=None):
        refuse_inside_trace(algorithm)
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self._keys = GradientKeys()
        self._agreed = False  # parameters checked across ranks (once, at the first compress)
        self._in_order = InOrderHostExchanges()
        self._recorded = []  # (key, gradient) compressed but not yet exchanged
        self._results = {}   # key -> (summed gradient tensor, shape, dtype)

    def compress(self, tensor, name=None):
        check_caller(self.algorithm.name, Adasum)
        if not self._agreed:
            self._agree_across_ranks()
            self._agreed = True
        key = self._keys.of(tensor, self.algorithm, name)
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
        scaled = summed * (tensor[0] / float(self.world_size))
        return tf.cast(tf.reshape(scaled, shape), dtype)

    # Trace-time Python (a collective on a private communicator): autograph must not convert it.
    @tf.autograph.experimental.do_not_convert
    def _agree_across_ranks(self):
        """Different parameters or seeds on different ranks would exchange garbage: refuse on every rank."""
        check_same_on_every_rank(self.algorithm.spec, communicator_of(None),
                                 "compressors or parameters")

    def _exchange_recorded(self):
        recorded, self._recorded = self._recorded, []
        layout = GradientLayout([(key, self.ops.shape(g), self.ops.dtype_name(g)) for key, g in recorded])
        sparsifier = self.pipeline_for(tuple(key for key, _ in recorded), layout)
        self._results.update(self._in_order.run(lambda buffer: sparsifier.step(buffer, tag=layout.tag),
                                                recorded, layout))


class InOrderHostExchanges:
    """Host exchanges (``tf.numpy_function``), run in trace order on every rank.

    TensorFlow may run independent ops in any order, but every rank must enter the collectives
    in the same order: inside ``tf.function`` each exchange reads a shared token variable
    before it runs and increments it after (automatic control dependencies then serialise
    them); in a plain TF1-style graph each takes an input from the previous one's ``tf.cond``.

        parts = InOrderHostExchanges().run(lambda flat: pipeline.step(flat), [(key, grad)], layout)
        part, shape, dtype = parts[key]     # the gradient's part of the float32 sum
    """

    def __init__(self):
        self._token = None                  # orders the exchanges inside tf.function
        self._chain = GraphExchangeChain()  # orders them in a plain (TF1-style) graph

    def run(self, exchange, recorded, layout):
        """``exchange(flat)`` (numpy float32 in and out, ``layout.n`` values) of the gradients
        ``recorded`` (``[(key, tensor)]``, laid out by ``layout``) fused as float32; returns
        ``{key: (its part of the result, its shape, its dtype)}``."""
        flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for _, g in recorded], axis=0)

        def call(buffer, *_order):
            return exchange(buffer)

        if in_graph_mode():  # no automatic control dependencies: chain the tf.conds by hand
            summed = tf.numpy_function(call, [flat, *self._chain.after_previous()], tf.float32, stateful=True)
            self._chain.traced(summed)
        else:
            token = self._token_variable()
            summed = tf.numpy_function(call, [flat, token.read_value()], tf.float32, stateful=True)
            with tf.control_dependencies([summed]):
                token.assign_add(1)
        summed.set_shape([layout.n])
        return {key: (summed[entry.offset:entry.offset + entry.size], entry.shape, g.dtype)
                for entry, (key, g) in zip(layout.entries, recorded)}

    def _token_variable(self):
        if self._token is None:
            with tf.init_scope():
                self._token = tf.Variable(0, dtype=tf.int64, trainable=False, name="exchange_token")
        return self._token

