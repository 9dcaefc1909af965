"""What the PyTorch and TensorFlow frontends share for the out-of-band compressors
(sparsifiers, bit-packed quantizers, PowerSGD, FFT), whose exchange Horovod's dense
allreduce cannot carry.

Their gradients go through a pipeline made by ``algorithm.make_pipeline(n, comm)``
(e.g. a :class:`~horovod_sparse.sparsify.Sparsifier`: error feedback, selection, the
sparse allreduce over mpi4py, residual update), on the gradient's own framework and
device, and Horovod's allreduce carries only a one-element probe of 1.0 per gradient:
the reduced probe is 1 under Average and P under Sum (pre/postscale factors included),
and scales the pipeline's sum accordingly (see :mod:`horovod_sparse.horovod_frames`).

Gradients smaller than ``dense_below`` elements (biases, norms), and non-float ones,
skip the pipeline and go through Horovod's allreduce as they are, as CGX does: a
sparse exchange of a few hundred values costs more in latency than it saves.
"""
import os

from horovod_sparse.agreement import raise_on_every_rank
from horovod_sparse.compressors.cast import NoneCompressor
from horovod_sparse.compressors.base import check_nonnegative_int
from horovod_sparse.layout import GradientLayout

#: default size (elements) under which a gradient skips sparsification
DEFAULT_DENSE_BELOW = 1024


#: why an elastic launch is refused for a compressor that keeps state and is not in the elastic state
ELASTIC_MESSAGE = (
    "elastic Horovod (horovodrun --min-np/--max-np) re-initialises Horovod whenever workers come or go, and "
    "this compressor's state (residuals, step counters, the exchanges' operation names and world size) must be "
    "carried across that, or the ranks would disagree after a resize and an exchange could wait forever. "
    "PyTorch: pass it to the elastic state, hvd.elastic.TorchState(model=..., optimizer=..., "
    "compression=compression) (horovod_sparse.torch.elastic; not the in-band randomk yet). Otherwise launch a "
    "fixed number of workers (horovodrun --gloo -np N, horovodrun -np N, mpirun), or train elastic jobs with a "
    "stateless compression (horovod_sparse's fp16 or none, or hvd.Compression.fp16)")


def ring_bytes(payload_bytes, world_size):
    """Bytes a rank sends in a ring allreduce of ``payload_bytes``: 2(P-1)/P of them."""
    return 0 if world_size <= 1 else 2 * (world_size - 1) * payload_bytes / world_size


def refuse_what_the_transport_cannot_carry(comm, algorithms, schedule="after_backward", in_elastic_state=False):
    """Over Horovod's collectives (``comm`` without point-to-point messages: a Gloo or elastic
    launch, or ``HOROVOD_SPARSE_TRANSPORT=horovod``) raise ValueError, naming the compressor, for
    a planned ``schedule`` (its channel threads would issue Horovod operations in an order that
    differs between ranks); under elastic Horovod, HorovodWorldError for any of them that keeps state,
    unless the compressor is in the job's elastic state (``in_elastic_state``:
    :mod:`horovod_sparse.torch.elastic` carries it across resizes; :data:`ELASTIC_MESSAGE`).
    Local, and the same on every rank: all raise, before any exchange.

    Example: ``refuse_what_the_transport_cannot_carry(comm, [horovod_sparse.create("topk")], "mgwfbp")``
    raises under ``horovodrun --gloo``.
    """
    if getattr(comm, "point_to_point", True):
        return
    stateful = [a.name for a in algorithms if getattr(a, "stateful", True)]
    if stateful and not in_elastic_state and os.environ.get("HOROVOD_ELASTIC") == "1":  # set for elastic workers only
        from horovod_sparse.errors import HorovodWorldError
        raise HorovodWorldError(f"{', '.join(stateful)}: {ELASTIC_MESSAGE}")
    if schedule != "after_backward":
        raise ValueError(
            f"{', '.join(a.name for a in algorithms)}: schedule={schedule!r} exchanges on helper threads, which "
            f"Horovod's collectives (the transport here: {comm.reason}) cannot order alike on every rank. Use "
            "schedule='after_backward', or launch through MPI (horovodrun without --gloo, or mpirun)")


class OutOfBandCompressorBase:
    """State shared by the frontends' sparse compressors.

    Attributes:
        algorithm: the registered compressor (``algorithm.make_pipeline(n, comm)``).
        dense_below: gradients with fewer elements go dense through Horovod.
        sparsifiers: ``{key: (GradientLayout, pipeline)}``, one per exchanged buffer
            (PyTorch: one for the whole fused step, remade when its layout changes;
            TensorFlow: one per gradient or group).
    """

    ops = None  # the frontend's ArrayOps
    #: what the last change of elastic Horovod's world carried over, and the handler that carries
    #: it (:mod:`horovod_sparse.torch.elastic`; None outside an elastic state)
    elastic_report = elastic_handler = None

    def __init__(self, algorithm, dense_below=DEFAULT_DENSE_BELOW):
        self.algorithm = algorithm
        self.dense_below = check_nonnegative_int("dense_below", dense_below)
        self.pipelines = {}
        self._dense = NoneCompressor()
        self._pending_state = {}
        self._comm = None
        # gradient key -> (its bytes uncompressed, bytes handed to Horovod's allreduce), last step
        self._bytes = {}

    @property
    def comm(self):
        """The exchanges' communicator: the caller's process set's, once a frontend has set it
        (:meth:`use_communicator`), else Horovod's whole world
        (:func:`~horovod_sparse.agreement.communicator_of`), never mpi4py's ``COMM_WORLD`` as
        such (Horovod may run on a part of it)."""
        if self._comm is None:
            from horovod_sparse.agreement import communicator_of
            self.use_communicator(communicator_of(None))
        return self._comm

    def use_communicator(self, comm):
        """Exchange on ``comm`` from now on; its size is read here, once. Over Horovod's
        collectives (a communicator without point-to-point messages: a Gloo or elastic launch)
        refuses, on every rank alike, what they cannot carry: a planned schedule (its channel
        threads would issue Horovod operations in an order that differs between ranks)."""
        refuse_what_the_transport_cannot_carry(comm, [self.algorithm], getattr(self, "schedule", "after_backward"),
                                               in_elastic_state=self.elastic_handler is not None)
        self._comm, self._world_size = comm, comm.Get_size()

    @property
    def world_size(self):
        """P, the size of ``comm``, read when it was set: ``decompress`` makes no MPI call after
        the step's last exchange. Where Horovod started MPI, Horovod finalises it on every rank
        once any rank exits, so a rank still finishing its last step would call into a finalised
        MPI (a crash)."""
        self.comm  # noqa: B018  (sets it on first use)
        return self._world_size

    def goes_dense(self, tensor):
        return not self.ops.is_float(tensor) or self.ops.numel(tensor) < self.dense_below

    def compress_dense(self, tensor, key, codec=None):
        """``tensor`` for Horovod's allreduce as it is, or cast by ``codec`` (a
        :class:`~horovod_sparse.compressors.cast.CastCompressor`; ``decompress_dense`` undoes either)."""
        payload, ctx = (codec or self._dense).compress(self.ops, tensor, None)
        self.record(key, tensor, payload)
        return payload, ("dense", ctx)

    def record(self, key, tensor, payload):
        """Remember the sizes of one gradient and of what Horovod carries for it."""
        self._bytes[key] = (self.ops.nbytes(tensor), self.ops.nbytes(payload))

    def decompress_dense(self, payload, ctx):
        return self._dense.decompress(self.ops, payload, ctx)

    def pipeline_for(self, key, layout):
        """The sparsifier exchanging ``layout`` under ``key``, created on first use."""
        if key in self.pipelines:
            known, sparsifier = self.pipelines[key]
            if known != layout:
                raise ValueError(
                    f"the gradients of {self.algorithm.name} changed: were [{known.describe()}], now "
                    f"[{layout.describe()}]. Their residuals cannot carry over; use a new compressor "
                    "(one per optimizer) if the model's trainable parameters change")
            return sparsifier
        pipeline, problem = self.algorithm.make_pipeline(layout.n, self.comm, layout=layout), None
        if key in self._pending_state:  # a checkpoint's state: a rank that cannot load it fails on every rank
            try:
                pipeline.load_state_dict(self._pending_state[key])
            except ValueError as e:
                problem = f"{self.algorithm.name}: the saved state of {key!r} cannot be loaded: {e}"
            try:
                raise_on_every_rank(self.comm, problem)
            except ValueError:
                pipeline.close()  # the state stays pending, as it was
                raise
            del self._pending_state[key]
        self.pipelines[key] = (layout, pipeline)
        return pipeline

    # -- checkpointing ----------------------------------------------------------------
    def state_dict(self):
        """``{key: sparsifier state}`` (numpy arrays and ints); each rank saves its own."""
        return {key: dict(sparsifier.state_dict(), layout=layout.describe())
                for key, (layout, sparsifier) in self.pipelines.items()}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`; buffers not yet created are restored on first use."""
        for key, entry in state_dict.items():
            entry = {k: v for k, v in entry.items() if k != "layout"}
            if key in self.pipelines:
                self.pipelines[key][1].load_state_dict(entry)
            else:
                self._pending_state[key] = entry

    def regime(self):
        """``{buffer key: what its next step does}``: a warm-up's phase where one is under way
        (:mod:`horovod_sparse.warmup`), else ``"steady"``. The same on every rank.

        Example: ``{"(fused)": "warm-up: density 0.0955, falling to 0.01 by step 200"}``.
        """
        return {key: pipeline.regime() for key, (_, pipeline) in self.pipelines.items()}

    # -- accounting --------------------------------------------------------------------
    def exchanging_pipelines(self):
        """The pipelines that exchange this compressor's gradients."""
        return [pipeline for _, pipeline in self.pipelines.values()]

    @property
    def dense_bytes_per_step(self):
        """Bytes of the gradients uncompressed, per step."""
        return sum(dense for dense, _ in self._bytes.values())

    def bytes_sent_per_step(self, world_size):
        """Bytes this rank sent in the last step: the sparse exchanges' counted bytes plus a
        ring allreduce's share of what Horovod carried (small dense gradients and probes)."""
        sparse = sum(s.last.traffic.bytes_sent for s in self.exchanging_pipelines()
                     if getattr(s, "last", None) is not None)
        return sparse + ring_bytes(sum(carried for _, carried in self._bytes.values()), world_size)

    def close(self):
        for _, sparsifier in self.pipelines.values():
            sparsifier.close()

    def __repr__(self):
        return f"{type(self).__name__}({self.algorithm.spec!r}, dense_below={self.dense_below})"
