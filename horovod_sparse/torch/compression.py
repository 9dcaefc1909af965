"""The PyTorch Horovod compressor: one framework-free compressor bound to torch ops."""
import sys

from horovod.torch import mpi_ops as horovod_mpi_ops
from horovod.torch.compression import Compressor as HorovodCompressor

from horovod_sparse.catalogue import make_compression_namespace
from horovod_sparse.in_band import InBandCompressorBase
from horovod_sparse.horovod_frames import OneOptimizer, caller_gradient
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.torch.auto import TorchAutoCompressor
from horovod_sparse.torch.out_of_band import TorchOutOfBandCompressor


class TorchCompressor(InBandCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` running a horovod_sparse compressor.

    Each gradient's state is keyed by its parameter's name, read from the calling Horovod
    code (:func:`~horovod_sparse.horovod_frames.caller_gradient`), so the order of
    ``compress`` calls does not matter: ``hvd.DistributedOptimizer`` reduces the gradients
    missing from the backward pass in ``synchronize()``, in an order that can differ between
    steps and ranks. Where no name is visible (a direct ``compress`` call) the key is the
    gradient's position in the step: every gradient of a step is compressed before the
    step's first ``decompress``, so the first ``compress`` after a ``decompress`` is position 0.

    A frozen parameter (``requires_grad`` False, e.g. the first layers while fine-tuning)
    still reaches Horovod, which reduces its zero gradient: it goes through uncompressed, and
    its residual is kept, untouched, for when it is unfrozen (it must not leak into a frozen
    parameter's update).

    A loss scaler's overflow (``torch.amp.GradScaler``: some rank's gradient holds inf or NaN)
    gives that gradient a NaN result on every rank, so the scaler skips the step on every rank,
    and the step leaves ``randomk``'s residuals and step counters as they were: each gradient
    commits in ``decompress`` once its reduced payload is finite, and the step's commits are
    rolled back at the next step's first ``compress`` (or ``state_dict()``) if any gradient of
    it overflowed (:mod:`horovod_sparse.slots`). ``nonfinite="raise"`` raises
    :class:`~horovod_sparse.exchange.NonFiniteGradientError` on every rank instead
    (:mod:`horovod_sparse.nonfinite`)::

        opt.synchronize()                      # the GradScaler way, with Horovod
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)                   # skipped where a gradient is not finite
        scaler.update()

    Buffers: ``fp16`` casts into a float16 buffer kept per gradient and reused every step, and
    ``decompress`` writes the result into the gradient itself (``fp16``, ``randomk``) and returns
    it, as ``hvd.DistributedOptimizer`` makes the result the gradient (``p.grad.set_``): no
    100 MB allocations per step. So a payload is valid until the same gradient's next
    ``compress`` (Horovod's allreduce has reduced it by then), and the tensor given to
    ``compress`` is handed over (it holds the result after ``decompress``; code calling
    ``compress``/``decompress`` itself must not expect it unchanged). ``hvd.allreduce`` and
    ``hvd.grouped_allreduce`` promise to leave their input as it is: under them ``decompress``
    returns a new tensor. A result is never one of the compressor's own buffers. A gradient
    that requires grad, a view, a non-contiguous or an inference tensor, or a call traced by
    ``torch.compile`` gets new tensors (:mod:`horovod_sparse.ops.torch_ops`).

    Use one instance per optimizer. ``state_dict()``/``load_state_dict()`` save and restore
    residuals and step counters by key (see :class:`~horovod_sparse.in_band.InBandCompressorBase`).

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=TorchCompressor.from_spec("randomk:density=0.01"))
    """

    ops = TorchOps()

    def __init__(self, algorithm, nonfinite="propagate"):
        super().__init__(algorithm, nonfinite)
        self._position = 0          # position of the next compress call in this step
        self._step_finished = False  # set by decompress: the next compress starts a step
        self._optimizer = OneOptimizer(algorithm.name)

    def compress(self, tensor):
        if self._step_finished:
            self._position, self._step_finished = 0, False
        name, parameter, optimizer = caller_gradient(tensor, optimizer=True)
        if self.algorithm.stateful:  # a second optimizer would mix its residuals with the first's
            self._optimizer.check(optimizer)
        key = self._position if name is None else name
        self._position += 1
        if self.algorithm.stateful and parameter is not None and not parameter.requires_grad:
            return tensor, None  # frozen: Horovod's allreduce as is; decompress passes it through
        return self.compress_slot(tensor, key, in_place=not under_functional_allreduce())

    def decompress(self, tensor, ctx):
        # Sparse gradients (nn.Embedding(sparse=True)) skip compress, and Horovod hands
        # decompress the allgathered sparse tensor with ctx=None: it passes through.
        self._step_finished = True
        return super().decompress(tensor, ctx)


#: Horovod's collectives that promise to leave their input unchanged and call ``compress``
_FUNCTIONAL = tuple(getattr(horovod_mpi_ops, name).__code__ for name in ("allreduce", "grouped_allreduce"))


def under_functional_allreduce(depth=6):
    """Whether ``hvd.allreduce`` or ``hvd.grouped_allreduce`` is calling (up to ``depth`` frames
    above the compressor's ``compress``: Compression's shared instance, the grouped call's
    comprehension and ``auto`` may stand between): their input must come back unchanged."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code in _FUNCTIONAL:
            return True
        frame = frame.f_back
    return False


Compression = make_compression_namespace(
    TorchCompressor, TorchOutOfBandCompressor,
    """Compressors for ``hvd.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TorchCompressor`, e.g.
    ``Compression.randomk(density=0.01)``, ``Compression.fp16()``; also
    ``Compression.from_spec("randomk:density=0.01")`` and ``Compression.available()``;
    ``Compression.auto()`` picks per gradient (:class:`~horovod_sparse.torch.auto.TorchAutoCompressor`).
    """, auto_cls=TorchAutoCompressor)
