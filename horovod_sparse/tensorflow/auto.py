"""``Compression.auto()`` for TensorFlow: per gradient, fp32, fp16 or one out-of-band candidate,
decided on the user's own job by measurement, behind ``hvd.DistributedGradientTape`` and the
Keras ``DistributedOptimizer``. How it decides: :mod:`horovod_sparse.auto.runtime`; where it
exchanges: :mod:`horovod_sparse.auto.host`.

Horovod traces ``compress`` once per gradient, so what Horovod's allreduce carries is fixed
at trace time: here it carries the gradients under ``dense_below`` elements (and non-float
ones) as they are, and a one-element probe for the others, whose exchange runs in one
``tf.numpy_function`` per Horovod exchange (one gradient, or one group with ``groups=``),
chained in trace order as :class:`~horovod_sparse.tensorflow.out_of_band.TFOutOfBandCompressor`
chains its own. Inside it the plan of the step applies, gradient by gradient, and can change
between steps without a new trace.

A loss scaler's overflow (:mod:`horovod_sparse.nonfinite`): at the step's first ``compress``
the whole gradient list is read from Horovod's ``allreduce_grads(grads, vars)`` frame, and one
host call, chained before the step's exchanges, hands the runtime whether each float gradient
of the step is finite on this rank and its largest and smallest element (TensorFlow reduces
each gradient to its sum, maximum and minimum, and looks at every element only when a sum is
not finite), which the runtime judges by the step's plan (an fp16 gradient past float16's
range overflows too). The ranks agree on it at the step's first exchange
(:mod:`horovod_sparse.auto.host`); an overflowed step changes no state of auto's and
every exchanged gradient's result is NaN on every rank (``nonfinite="propagate"``), or every
rank raises (``"raise"``: inside the traced step, TensorFlow's error carries the message of
:class:`~horovod_sparse.exchange.NonFiniteGradientError`). The first call of the step depends
on every gradient then; it is the first variable's, which backward computes last, so it
waited for nearly all of them already.
"""
import numpy as np
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor
from horovod.tensorflow.mpi_ops import Adasum

from horovod_sparse.agreement import check_same_on_every_rank, communicator_of
from horovod_sparse.auto.host import HostAutoRuntime
from horovod_sparse.horovod_frames import check_caller
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.tensorflow.construction import refuse_inside_trace
from horovod_sparse.tensorflow.gradient_keys import GradientKeys, horovod_gradients
from horovod_sparse.ops.namespace import concat_float32
from horovod_sparse.tensorflow.bucket_exchange import InOrderHostExchanges, dense_parts
from horovod_sparse.tensorflow.graph_mode import outermost_graph

#: the key of the step's verdict in its host call
VERDICT_KEY = "(gradients finite, largest, smallest)"


class _Auto:
    """What the trace-position keys and the inside-a-trace refusal name this compressor by."""
    name, stateful = "auto", True


class TFAutoCompressor(HorovodCompressor):
    """A ``horovod.tensorflow.compression.Compressor`` that picks, per gradient, what to compress and how.

    Args: as :class:`~horovod_sparse.torch.auto.TorchAutoCompressor` (``candidates``,
    ``dense_below``, the guard's ``min_density``, ``min_rank``, ``max_residual_ratio``, and
    ``profile_steps``, ``trial_steps``, ``max_trials``, ``prune``, ``drift``, ``check_every``,
    ``warmup_steps``, ``nonfinite``: ``"propagate"`` or ``"raise"``, what a step whose gradient overflowed on some
    rank gives: NaN results, or the error, with no state of auto's changed either way).
    ``guard_momentum`` is accepted and changes nothing here: TensorFlow's auto does not see the
    optimizer, so it has no optimizer guard (pass ``candidates`` under Adam or momentum).

    Gradients are keyed as in :class:`~horovod_sparse.tensorflow.TFCompressor` (the variable's
    name under Horovod's gradient allreduce). Create it outside the traced step; every rank
    checks at the first ``compress`` that all passed the same settings. ``auto_report``,
    ``plan``, ``state_dict()`` and ``load_state_dict()`` as in PyTorch.

    Example::

        compression = hvds.Compression.auto()
        tape = hvd.DistributedGradientTape(tape, compression=compression)
    """

    ops = TFOps()

    def __init__(self, *args, **kwargs):
        refuse_inside_trace(_Auto)
        self.runtime = HostAutoRuntime(*args, **kwargs)
        self._keys = GradientKeys()
        self._agreed = False
        self._in_order = InOrderHostExchanges()
        self._recorded = []                 # (key, gradient) compressed, not yet exchanged
        self._results = {}                  # key -> BucketPart, exchanged, not yet decompressed
        self._checked = []                  # the gradient list whose verdict call is traced
        self._world_size = None             # P, read at the first decompress

    @property
    def auto_report(self):
        """What was measured, predicted and chosen (see the PyTorch compressor's)."""
        return self.runtime.report

    @property
    def plan(self):
        return self.runtime.plan

    @property
    def phase(self):
        return self.runtime.phase

    @property
    def nonfinite(self):
        return self.runtime.nonfinite

    # AutoGraph converts Horovod's step and would convert every function of ours it calls: frame
    # walks and collectives on a private communicator it must not rewrite, and over a second of
    # parsing a trace. Ours trace as they are written, as in a TF1-style graph.
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor, name=None):
        check_caller("auto", Adasum)
        if not self._agreed:
            self._agree_across_ranks()
            self._agreed = True
        key = self._keys.of(tensor, _Auto, name)
        self._trace_verdict(tensor)
        if not tensor.dtype.is_floating or self.ops.numel(tensor) < self.runtime.dense_below:
            return tensor, ("dense", None)
        self._recorded.append((key, tensor))
        self.runtime.on_gpu = self.runtime.on_gpu or "GPU" in (tensor.device or "").upper()
        return tf.ones([1], tf.float32), ("auto", key)

    @tf.autograph.experimental.do_not_convert  # as compress
    def decompress(self, tensor, ctx):
        kind, key = ctx
        if kind == "dense":
            return tensor
        if key not in self._results:
            self._exchange_recorded()
        return self._results.pop(key).to_gradient(tensor[0] / float(self.world_size))

    @property
    def world_size(self):
        """P, read once, so that an eager ``decompress`` makes no MPI call after the step's last
        exchange (out_of_band.py's ``world_size`` says why)."""
        if self._world_size is None:
            self._world_size = communicator_of(None).Get_size()
        return self._world_size

    def _agree_across_ranks(self):
        check_same_on_every_rank(self.runtime.settings(), communicator_of(None), "auto settings")

    def _trace_verdict(self, tensor):
        """At the step's first ``compress``, trace the host call that hands the runtime, per
        float gradient of the step, whether it is finite and its largest and smallest element,
        in the graph around Horovod's ``tf.cond``s and chained before the step's exchanges
        (module docstring). Nothing where no gradient list is in sight: each exchange then
        judges its own gradients."""
        if any(g is tensor for g in self._checked):
            return
        found = horovod_gradients(tensor)
        if found is None:
            return
        self._checked = [g for _, g in found if g is not None]
        named = [(key, g) for key, g in found if g is not None and g.dtype.is_floating]
        if not named:
            return
        keys = [key for key, _ in named]
        values = [g.values if isinstance(g, tf.IndexedSlices) else g for _, g in named]
        sizes = [None if isinstance(g, tf.IndexedSlices) else g.shape.num_elements() for _, g in named]
        runtime, n = self.runtime, len(values)

        def note(pieces):
            verdict = pieces[0]
            runtime.step_verdict(keys, sizes, verdict[:n] > 0, verdict[n:2 * n], verdict[2 * n:])
            return [np.zeros(3 * n, np.float32)]

        with outermost_graph().as_default():
            sums = tf.stack([tf.cast(tf.reduce_sum(v), tf.float32) for v in values])
            # an inf or a NaN makes its gradient's sum non-finite; a finite sum vouches for every element
            finite = tf.cond(tf.reduce_all(tf.math.is_finite(sums)), lambda: tf.ones([n], tf.bool),
                             lambda: tf.stack([tf.reduce_all(tf.math.is_finite(v)) for v in values]))
            highs = tf.stack([tf.cast(tf.reduce_max(v), tf.float32) for v in values])
            lows = tf.stack([tf.cast(tf.reduce_min(v), tf.float32) for v in values])
            verdict = tf.concat([tf.cast(finite, tf.float32), highs, lows], 0)
            self._in_order.run(note, [(VERDICT_KEY, verdict)], GradientLayout([(VERDICT_KEY, (3 * n,), "float32")]))

    def _exchange_recorded(self):
        recorded, self._recorded = self._recorded, []
        keys = tuple(key for key, _ in recorded)
        layout = GradientLayout([(key, self.ops.shape(g), self.ops.dtype_name(g)) for key, g in recorded])
        runtime = self.runtime
        self._results.update(self._in_order.run(
            lambda pieces: dense_parts(layout, runtime.exchange(keys, layout, concat_float32(pieces))),
            recorded, layout))

    # -- checkpointing -------------------------------------------------------------------------
    def state_dict(self):
        """The plan, the phase and every candidate's state by gradient (numpy and numbers)."""
        return self.runtime.state_dict()

    def load_state_dict(self, state_dict):
        self.runtime.load_state_dict(state_dict)

    def close(self):
        self.runtime.close()

    def __repr__(self):
        return f"TFAutoCompressor({self.runtime.settings()})"
