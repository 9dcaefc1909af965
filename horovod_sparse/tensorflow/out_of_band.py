"""The TensorFlow out-of-band compressor: exchanges Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT), one fused exchange per step.

Horovod's TensorFlow frontend calls ``compress`` for a gradient, allreduces its payload,
then calls ``decompress``, one gradient at a time, each inside its own ``tf.cond`` (with
``groups=``, a group at a time). ``compress`` hands Horovod a one-element probe (its reduced
value gives the Average/Sum scale, :mod:`horovod_sparse.out_of_band`), and where the
gradients travel is the ``schedule``'s business:

- ``"after_backward"`` (default, as in PyTorch): at the step's first ``compress`` the whole
  gradient list is read from Horovod's ``allreduce_grads(grads, vars)`` frame
  (:mod:`~horovod_sparse.tensorflow.gradient_keys`) and ONE exchange of every gradient is
  traced in the graph around the ``tf.cond``s, whatever Horovod's grouping; each
  ``decompress`` takes its part from there. Its pipeline belongs to the step's layout, made
  when the step runs (:class:`~horovod_sparse.layout_pipeline.LayoutPipeline`): a trace where a
  variable has no gradient, or leaves the list (frozen), moves each gradient's state by name,
  and the missing one keeps its residual until it returns;
- ``"wfbp"``: what Horovod hands over at once is exchanged at its first ``decompress``: one
  gradient, or one ``groups=`` group, each with its own pipeline (keyed by the tuple of its
  variables' names; a group that loses a variable is a new group, with fresh residuals);
- the planned schedules (``"mgwfbp"``, ``"optimal"``, ``"asc"``, ``"auto"``): the step's first
  ``compress`` traces one arrival call per gradient and one collecting call, and the
  schedule's runtime, PyTorch's, decides the buckets at run time: profiled steps, then a
  plan whose buckets go out on channel threads while backward goes on
  (:mod:`~horovod_sparse.tensorflow.planned_step`).

Each exchange is one host call in trace order on every rank
(:mod:`~horovod_sparse.tensorflow.bucket_exchange`): the gradients go in unfused, a sparsifier's
pairs (or another pipeline's dense sum) come out, and TensorFlow ops scatter them into the
gradients. On a GPU, or with ``on_device = True``, the pipeline's step runs as TensorFlow ops
on the gradients' device (every family: the compressor's ``tensorflow_ops``) and only its
payload crosses to numpy.
"""
import tensorflow as tf
from horovod.tensorflow.compression import Compressor as HorovodCompressor
from horovod.tensorflow.mpi_ops import Adasum

from horovod_sparse.agreement import agree_on_layout, check_same_on_every_rank, communicator_of
from horovod_sparse.checks import check_choice, check_positive_int
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.horovod_frames import check_caller
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import LayoutPipeline
from horovod_sparse.nonfinite import check_nonfinite, raise_with_hint
from horovod_sparse.ops.tf_ops import TFOps
from horovod_sparse.out_of_band import OutOfBandCompressorBase
from horovod_sparse.ops.namespace import concat_float32, copy_of
from horovod_sparse.schedule.planner import SCHEDULES
from horovod_sparse.step.exchanges import StepExchanges
from horovod_sparse.tensorflow.bucket_exchange import (InOrderHostExchanges, dense_parts, nonfinite_parts,
                                                      sparse_parts)
from horovod_sparse.tensorflow.construction import refuse_inside_trace
from horovod_sparse.tensorflow.gradient_keys import GradientKeys, horovod_gradients
from horovod_sparse.tensorflow.graph_mode import outermost_graph
from horovod_sparse.tensorflow.planned_step import PlannedStep
from horovod_sparse.tensorflow.step_arrays import HOST_ARRAYS


class TFOutOfBandCompressor(OutOfBandCompressorBase, HorovodCompressor):
    """A real ``horovod.tensorflow.compression.Compressor`` running out-of-band pipelines out of band.

    Args:
        algorithm: an out-of-band compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.
        schedule: ``"after_backward"`` (default: one fused exchange of the step's gradients),
            ``"wfbp"`` (one exchange per gradient, or per Horovod group), or a planned
            schedule as in PyTorch (``"mgwfbp"``, ``"optimal"``, ``"asc"``, ``"auto"``); see the module.
        profile_steps, trial_steps: the planned schedules' profiled steps and, with ``"auto"``,
            timed steps per candidate plan (integers >= 1; as
            :class:`~horovod_sparse.torch.out_of_band.TorchOutOfBandCompressor`).
        nonfinite: when some rank's gradient holds inf or NaN (a loss scaler's overflow), no
            state changes and every out-of-band gradient of the step is NaN on every rank
            (``"propagate"``, default), or every rank raises (``"raise"``: inside the traced
            step, TensorFlow's error carries the message of
            :class:`~horovod_sparse.exchange.NonFiniteGradientError`). See
            :mod:`horovod_sparse.nonfinite`.

    Gradients are identified as in :class:`~horovod_sparse.tensorflow.TFCompressor` (variable
    name under Horovod's gradient allreduce, else position in the traced function;
    ``compress(tensor, name=...)`` when called eagerly; such calls, outside Horovod's gradient
    list, are exchanged one at a time). Create it outside the traced step (inside, it raises
    RuntimeError); at its first ``compress`` every rank checks that all passed the same
    compressor and parameters (ValueError on every rank). ``on_device = True`` runs the
    pipeline's step as TensorFlow ops on the CPU too, as it runs on a GPU (the CPU default is
    numpy's kernels on zero-copy views of the gradients: the same bits, faster there; FFT and
    PowerSGD's products agree to float32 rounding, see their modules).

    Example::

        compression = hvds.Compression.topk(density=0.01)   # TFOutOfBandCompressor
        tape = hvd.DistributedGradientTape(tape, compression=compression)
    """

    ops = TFOps()

    def __init__(self, algorithm, dense_below=None, schedule="after_backward", profile_steps=3, trial_steps=5,
                 nonfinite="propagate"):
        refuse_inside_trace(algorithm)
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self.nonfinite = check_nonfinite(nonfinite)
        self.schedule = check_choice("schedule", schedule, SCHEDULES)
        self.profile_steps = check_positive_int("profile_steps", profile_steps)
        self.trial_steps = check_positive_int("trial_steps", trial_steps)
        # a planned schedule's runtime: the buckets are decided when the step runs, not traced
        self.planned = None if schedule in ("after_backward", "wfbp") else PlannedStep(
            StepExchanges(algorithm, HOST_ARRAYS, schedule, self.profile_steps, self.trial_steps), lambda: self.comm,
            self.nonfinite_parts)
        # the whole step's pipeline (after_backward): each gradient's state follows it by key
        # when the step's set of gradients changes (a variable without gradient, or frozen)
        self.step_pipelines = LayoutPipeline(
            lambda layout: algorithm.make_pipeline(layout.n, self.comm, layout=layout))
        self._step_graph = None  # the traced graph whose step exchange is in _results
        self._keys = GradientKeys()
        self._agreed = False  # parameters checked across ranks (once, at the first compress)
        self._in_order = InOrderHostExchanges()
        self._recorded = []  # (key, gradient) compressed but not yet exchanged
        self._results = {}   # key -> BucketPart, exchanged but not yet decompressed
        #: run the pipeline as TensorFlow ops even on the CPU, as it runs on a GPU (the CPU
        #: default is numpy's kernels on zero-copy views of the gradients: faster there)
        self.on_device = False

    # AutoGraph converts Horovod's step and would convert every function of ours it calls: frame
    # walks and collectives on a private communicator it must not rewrite, and over a second of
    # parsing a trace. Ours trace as they are written, as in a TF1-style graph.
    @tf.autograph.experimental.do_not_convert
    def compress(self, tensor, name=None):
        check_caller(self.algorithm.name, Adasum)
        if not self._agreed:
            self._agree_across_ranks()
            self._agreed = True
        key = self._keys.of(tensor, self.algorithm, name)
        if self.goes_dense(tensor):
            return self.compress_dense(tensor, key)
        probe = tf.ones([1], tf.float32)
        self.record(key, tensor, probe)
        if key in self._results and self._step_graph is outermost_graph():
            return probe, ("sparse", key)  # the step's exchange, traced at its first gradient, has it
        step = self._step_gradients(tensor) if self.schedule != "wfbp" and name is None else None
        if step is None:  # wfbp, or no gradient list in sight: the bucket is what Horovod hands over
            self._recorded.append((key, tensor))
        else:
            self._exchange_step(*step)
        return probe, ("sparse", key)

    @tf.autograph.experimental.do_not_convert  # as compress
    def decompress(self, tensor, ctx):
        kind, info = ctx
        if kind == "dense":
            return self.decompress_dense(tensor, info)
        if info not in self._results:
            self._exchange_recorded()
        return self._results.pop(info).to_gradient(tensor[0] / float(self.world_size))

    def _agree_across_ranks(self):
        """Different parameters or seeds on different ranks would exchange garbage: refuse on every rank."""
        check_same_on_every_rank(self.algorithm.spec, communicator_of(None),
                                 "compressors or parameters")

    def _step_gradients(self, tensor):
        """``([(key, gradient)], carried)``: every gradient of the step that goes through the
        pipeline, and the float ones Horovod carries as they are (small: their overflow skips
        the exchange too), read from Horovod's gradient list (None outside Horovod's gradient
        allreduce)."""
        found = horovod_gradients(tensor)
        if found is None:
            return None
        gradients = [(key, g) for key, g in found if isinstance(g, tf.Tensor)]
        return ([(key, g) for key, g in gradients if not self.goes_dense(g)],
                [g for _, g in gradients if self.goes_dense(g) and g.dtype.is_floating])

    def _exchange_step(self, step, carried):
        """Trace the whole step's exchange now, at its first gradient's ``compress``, in the graph
        around Horovod's per-gradient ``tf.cond``s (each ``decompress`` then takes its part from
        there): one exchange after backward, whatever Horovod's grouping, as in PyTorch. The
        pipeline is the layout's, chosen when the step runs: a step with another set of
        gradients (a trace where a variable has none) moves their state by key. An overflow in a
        ``carried`` gradient (one Horovod carries as it is) skips the exchange too."""
        layout = GradientLayout([(key, self.ops.shape(g), self.ops.dtype_name(g)) for key, g in step])
        with outermost_graph().as_default():
            if self.planned is None:
                self._results.update(self._trace_exchange(self._step_pipeline, step, layout, carried))
            else:
                self._results.update(self.planned.trace(self._in_order, step, layout, self.algorithm.sparse_result,
                                                        self._on_device(step), carried))
        self._step_graph = outermost_graph()

    def _step_pipeline(self, layout):
        """The whole step's pipeline for ``layout``, at run time. The ranks first agree on the
        layout (one Allgather of three int64), so ranks whose traced steps differ fail together
        instead of waiting in different collectives; a new pipeline is collective, and a rank
        that cannot take the gradients' saved state fails on every rank."""
        agree_on_layout(layout, self.comm, self.algorithm.name)
        return self.step_pipelines.for_layout_on_every_rank(layout, self.comm, self.algorithm.name)

    def _exchange_recorded(self):
        """One exchange of the bucket recorded so far (:mod:`~horovod_sparse.tensorflow.bucket_exchange`):
        a sparsifier reads the pieces in place and returns its pairs; the other pipelines get
        them fused into one float32 buffer and return the dense sum."""
        recorded, self._recorded = self._recorded, []
        layout = GradientLayout([(key, self.ops.shape(g), self.ops.dtype_name(g)) for key, g in recorded])
        pipeline = self.pipeline_for(tuple(key for key, _ in recorded), layout)
        self._results.update(self._trace_exchange(lambda _: pipeline, recorded, layout))

    def _trace_exchange(self, pipeline_of, recorded, layout, carried=()):
        """Trace one exchange of ``recorded`` through ``pipeline_of(layout)``: a sparsifier reads
        the pieces in place and returns its pairs; the other pipelines get them fused into one
        float32 buffer and return the dense sum. Returns ``{key: BucketPart}``."""
        sparse = self.algorithm.sparse_result

        def exchange(pieces, finite):
            pipeline = pipeline_of(layout)
            try:
                if sparse:
                    return sparse_parts(layout, *pipeline.step_sparse(pieces, tag=layout.tag, finite=finite))
                summed = pipeline.step(concat_float32(pieces), tag=layout.tag, finite=finite)
            except NonFiniteGradientError as error:
                return self.nonfinite_parts(error, layout)
            # TensorFlow keeps what the host call returns without copying it: not a reused buffer
            return dense_parts(layout, summed if pipeline.fresh_result else copy_of(summed))

        return self._in_order.run(exchange, recorded, layout, sparse=sparse, on_device=self._on_device(recorded),
                                  carried=list(carried))

    def nonfinite_parts(self, error, layout):
        """The parts of a step whose gradient overflowed on some rank (every rank is here: the
        check was agreed): NaN, or the error again with ``nonfinite="raise"``."""
        if self.nonfinite == "raise":
            raise_with_hint(error)
        return nonfinite_parts(layout, self.algorithm.sparse_result)

    def _on_device(self, recorded):
        """A pipeline with a TensorFlow spelling runs as TensorFlow ops where the gradients are (on
        a GPU, or when asked); one without runs on numpy (a host copy of the gradients on a GPU)."""
        return self.algorithm.tensorflow_ops and (self.on_device or any(_on_gpu(g) for _, g in recorded))

    @property
    def schedule_report(self):
        """A planned schedule's report once planned (what was measured and chosen), else None."""
        return None if self.planned is None else self.planned.exchanges.report

    def last_step_timeline(self):
        """A planned schedule's last step: when its gradients arrived and its buckets were
        exchanged (:meth:`~horovod_sparse.step.channels.ChannelExchanges.timeline`); None before."""
        return None if self.planned is None else self.planned.exchanges.timeline()

    # -- checkpointing: the buckets' pipelines, and the whole step's by gradient -----------
    def state_dict(self):
        """``{bucket: pipeline state}`` (``schedule="wfbp"``: one gradient, or a Horovod group as a
        tuple of names) and, for the whole step's exchange, ``{STEP_KEY: {gradient key: its
        slices, "(fused)": the whole buffer's state (a planned schedule's: its plan too)}}``.
        Each rank saves its own."""
        state = super().state_dict()
        step = self._step_runtime().state_dict()
        if step:
            state[STEP_KEY] = step
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`; pipelines not yet made take their state at first use."""
        state_dict = dict(state_dict)
        step = state_dict.pop(STEP_KEY, None)
        if step is not None:
            self._step_runtime().load_state_dict(step)
        super().load_state_dict(state_dict)

    def _step_runtime(self):
        """What holds the whole step's state: the planned schedule's runtime, or the step's pipeline."""
        return self.step_pipelines if self.planned is None else self.planned.exchanges

    def exchanging_pipelines(self):
        if self.planned is not None:
            step = [pipeline for _, pipeline in self.planned.exchanges.pipelines.values()]
        else:
            step = [] if self.step_pipelines.pipeline is None else [self.step_pipelines.pipeline]
        return super().exchanging_pipelines() + step

    def close(self):
        """Free the pipelines' communicators (and a planned schedule's channels), and their
        buffers: the traced step keeps this compressor alive as long as TensorFlow keeps the
        step's graph."""
        super().close()
        self.step_pipelines.close()
        self.pipelines, self._results = {}, {}
        self.step_pipelines = LayoutPipeline(self.step_pipelines.make)
        if self.planned is not None:
            self.planned.exchanges.close()
            self.planned.exchanges = StepExchanges(self.algorithm, HOST_ARRAYS, self.schedule,
                                                   self.profile_steps, self.trial_steps)


#: key of the whole step's exchange in :meth:`TFOutOfBandCompressor.state_dict`
STEP_KEY = "(step)"


def _on_gpu(tensor):
    return "GPU" in (tensor.device or "").upper()
