"""The PyTorch Horovod compressor: one framework-free compressor bound to torch ops."""
from horovod.torch.compression import Compressor as HorovodCompressor

from horovod_sparse.adapter import CompressorAdapter, make_compression_namespace
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.torch.fused import TorchOutOfBandCompressor


class TorchCompressor(CompressorAdapter, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` running a horovod_sparse compressor.

    Gradients are identified by their position in the step: ``hvd.DistributedOptimizer``
    calls ``compress`` for every gradient of a step (in backward order, the same on every
    rank) before the first ``decompress`` of that step, in ``synchronize()``. So the
    first ``compress`` after a ``decompress`` starts a new step at position 0.

    Use one instance per optimizer. ``state_dict()``/``load_state_dict()`` save and
    restore residuals and step counters (see :class:`~horovod_sparse.adapter.CompressorAdapter`).
    """

    ops = TorchOps()

    def __init__(self, algorithm):
        super().__init__(algorithm)
        self._position = 0          # position of the next compress call in this step
        self._step_finished = False  # set by decompress: the next compress starts a step

    def compress(self, tensor):
        if self._step_finished:
            self._position, self._step_finished = 0, False
        key = self._position
        self._position += 1
        return self.compress_slot(tensor, key)

    def decompress(self, tensor, ctx):
        # Sparse gradients (nn.Embedding(sparse=True)) skip compress, and Horovod hands
        # decompress the allgathered sparse tensor with ctx=None: it passes through.
        self._step_finished = True
        return super().decompress(tensor, ctx)


Compression = make_compression_namespace(
    TorchCompressor, TorchOutOfBandCompressor,
    """Compressors for ``hvd.DistributedOptimizer(compression=...)``.

    Each attribute is a factory returning a new :class:`TorchCompressor`, e.g.
    ``Compression.randomk(density=0.01)``, ``Compression.fp16()``; also
    ``Compression.from_spec("randomk:density=0.01")`` and ``Compression.available()``.
    """)
