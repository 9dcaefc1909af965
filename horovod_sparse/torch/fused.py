"""The PyTorch sparse compressor: one fused sparse exchange per step, behind the stock
``hvd.DistributedOptimizer``.

Horovod calls ``compress`` for every gradient of a step (from the backward hooks and
``synchronize()``) before the step's first ``decompress``. So ``compress`` only
records the gradient and hands Horovod a one-element probe; the first ``decompress``
of the step fuses the recorded gradients, in recording order, into one buffer and runs
the sparsifier on it (error feedback, selection, sparse allreduce, residual update) —
one exchange per step, ordered identically on every rank because it is a single call.
The layout's signature travels with the exchange, so ranks whose gradients differ
fail together with a clear error instead of summing unrelated numbers.
"""
import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from horovod_sparse.horovod_checks import check_caller
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.sparse_adapter import SparseCompressorBase

FUSED_KEY = "fused"


class TorchSparseCompressor(SparseCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` running a sparsifier over the fused step.

    Args:
        algorithm: a sparsifying compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.

    The fused buffer is float32 (the sparsifier's dtype); results come back in each
    gradient's own dtype and device. Use one instance per optimizer.
    """

    ops = TorchOps()

    def __init__(self, algorithm, dense_below=None):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self._position = 0
        self._step_finished = False
        self._recorded = []    # (position, gradient) of this step, in compress order
        self._results = None   # position -> summed gradient, after the step's exchange
        self._caller_checked = False

    def compress(self, tensor):
        if self._step_finished:
            self._position, self._step_finished = 0, False
            self._recorded, self._results = [], None
        if not self._caller_checked:
            check_caller(self.algorithm.name, hvd.Adasum, _DistributedAdasumOptimizer._allreduce_grad_async.__code__)
            self._caller_checked = True
        position = self._position
        self._position += 1
        if self.goes_dense(tensor):
            return self.compress_dense(tensor, position)
        self._recorded.append((position, tensor))
        probe = torch.ones(1, dtype=torch.float32, device=tensor.device)
        self.record(position, tensor, probe)
        return probe, ("sparse", position)

    def decompress(self, tensor, ctx):
        self._step_finished = True
        if ctx is None:  # a sparse gradient (nn.Embedding(sparse=True)) Horovod allgathered
            return tensor
        kind, info = ctx
        if kind == "dense":
            return self.decompress_dense(tensor, info)
        if self._results is None:
            self._results = self._exchange()
        summed, dtype = self._results[info]
        return (summed * self.scale(tensor.item())).to(dtype)

    def _exchange(self):
        layout = GradientLayout([(position, tuple(g.shape), self.ops.dtype_name(g))
                                 for position, g in self._recorded])
        sparsifier = self.sparsifier_for(FUSED_KEY, layout)
        flat = layout.fuse([g.detach().float().cpu().numpy() for _, g in self._recorded])
        summed = torch.from_numpy(sparsifier.step(flat, tag=layout.tag))
        return {position: (part.to(g.device), g.dtype)
                for (position, g), part in zip(self._recorded, layout.split(summed))}
