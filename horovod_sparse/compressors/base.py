"""Base classes of the framework-free compressors. Their parameter checks live in
:mod:`horovod_sparse.checks` and are re-exported here."""
from horovod_sparse.checks import (check_bool, check_choice, check_fraction, check_int,  # noqa: F401
                                   check_nonnegative_int, check_positive_int, check_positive_number,
                                   check_unit_interval)

# Horovod's allreduce rejects bfloat16 (torch), so bfloat16 gradients travel as float32.
WIRE_DTYPE = {"bfloat16": "float32"}


class Compressor:
    """A gradient compressor's math.

    Subclasses set ``name`` and ``stateful`` and implement :meth:`compress` and
    :meth:`decompress`. ``compress`` returns the payload Horovod allreduces and a
    context; Horovod sums (or averages) the payloads of all ranks, and ``decompress``
    turns the reduced payload back into a gradient. A payload must therefore be
    linear: the reduction of payloads must be the payload of the reduced gradients.

    Non-float tensors pass through untouched; ``bfloat16`` travels as ``float32``.
    """

    name = "abstract"
    #: True if the compressor keeps per-tensor state (a residual, a step counter).
    stateful = False

    def __init__(self):
        self.params = {}

    def compress(self, ops, tensor, slot, in_place=False):
        """Return ``(payload, ctx)``. ``slot`` is the tensor's state (None if not stateful).
        ``in_place``: the caller hands ``tensor`` over, and ``decompress`` may write its result
        into it (and return it) where the framework can, instead of making a new tensor."""
        raise NotImplementedError

    def decompress(self, ops, payload, ctx):
        raise NotImplementedError

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{type(self).__name__}({args})"

    @property
    def spec(self):
        """The spec string that recreates this compressor, e.g. ``"randomk:density=0.01"``."""
        if not self.params:
            return self.name
        return self.name + ":" + ",".join(f"{k}={v}" for k, v in self.params.items())


class OutOfBandCompressor(Compressor):
    """A compressor whose exchange Horovod's dense allreduce cannot carry (sparsifiers,
    quantizers with bit-packed codes, PowerSGD, FFT).

    The frontends flatten a step's gradients into one float32 buffer of length n and
    call :meth:`make_pipeline` once per buffer, then ``pipeline.step(grad, tag=...)``
    every step on every rank; the pipeline runs its own exchange over mpi4py and
    returns the SUM over ranks of what the ranks contributed. Horovod's allreduce only
    carries a one-element probe (see :mod:`horovod_sparse.out_of_band`).
    ``compress``/``decompress`` are not used.
    """

    out_of_band = True
    stateful = True
    #: its pipeline has ``step_sparse`` (sorted indices and their sums, O(k)), not only ``step``
    sparse_result = False
    #: its pipeline's step also runs as TensorFlow ops on the gradients' device (every kernel
    #: it uses has a TensorFlow spelling): the TensorFlow frontend then runs it there on a GPU
    #: (or with ``on_device=True``) and only its payload crosses to numpy
    tensorflow_ops = False

    def dense_steps(self, size):
        """How many first steps every pipeline of this compressor sends whole, summing the
        gradients and keeping nothing back, at ``size`` ranks: its warm-up's dense steps
        (:mod:`horovod_sparse.warmup`; 0 without one). PyTorch's frontend hands those steps to
        Horovod's own allreduce."""
        return getattr(self, "warmup_steps", 0)

    def make_pipeline(self, n, comm, layout=None):
        """The pipeline for a buffer of ``n`` elements on ``comm`` (collective: every rank of
        ``comm`` must call it, in the same order).

        ``layout`` is the buffer's :class:`~horovod_sparse.layout.GradientLayout` (where each
        gradient lies, with its shape); compressors that work per matrix (PowerSGD) need
        it, the others ignore it. What is returned has the interface of
        :class:`~horovod_sparse.sparsify.Sparsifier`: ``step(grad, tag) -> sum over ranks``,
        ``last`` (with ``last.traffic``), ``traffic``, ``state_dict``/``load_state_dict``
        and ``close``."""
        raise NotImplementedError

    def compress(self, ops, tensor, slot):
        raise NotImplementedError(f"out-of-band compressor: {self.name} exchanges whole buffers through "
                                  "make_pipeline(n, comm).step(grad), not per-tensor compress()")

    def decompress(self, ops, payload, ctx):
        raise NotImplementedError(f"out-of-band compressor: {self.name} exchanges whole buffers through "
                                  "make_pipeline(n, comm).step(grad), not per-tensor decompress()")
