"""The PyTorch out-of-band compressor: one fused exchange per step, behind the stock
``hvd.DistributedOptimizer``, for the compressors Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT).

Horovod calls ``compress`` for every gradient of a step (from the backward hooks and
``synchronize()``) before the step's first ``decompress``. So:

1. ``compress`` records the gradient and hands Horovod a one-element probe (its
   reduced value gives the Average/Sum scale, :mod:`horovod_sparse.sparse_adapter`);
2. the step's first ``decompress`` runs the pipeline on the recorded gradients, in
   recording order, as one buffer: a sparsifier gets them as pieces of it (its memory
   reads them in place: grad + residual in one pass), the other pipelines a copy in one
   persistent float32 buffer on their device (:class:`FusedBuffer`). One exchange per
   step, ordered identically on every rank because it is a single call; the layout's
   signature travels with the exchange, so ranks whose gradients differ fail together
   with a clear error;
3. each ``decompress`` writes its gradient's part of the sum into the gradient tensor
   itself (zeroed, then the summed pairs scattered in for sparsifiers; copied from the
   dense sum for the others), scaled by its probe, and returns it - in place, as
   Horovod's own allreduce does. Only the pipeline's payload ever leaves the device.
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


class TorchOutOfBandCompressor(SparseCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` that exchanges the fused step out of band.

    Args:
        algorithm: a fused compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.

    The fused buffer is float32 on the gradients' device; results are written back in each
    gradient's own dtype and device. Use one instance per optimizer.
    """

    ops = TorchOps()

    def __init__(self, algorithm, dense_below=None):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self._position = 0
        self._step_finished = False
        self._recorded = []    # (position, gradient) of this step, in compress order
        self._results = None   # the step's StepSum, after its exchange
        self._buffer = FusedBuffer()
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
        return self._results.write(info, self.scale(tensor.item()))

    def _exchange(self):
        """Fuse the recorded gradients and run the step's one exchange."""
        layout = GradientLayout([(position, tuple(g.shape), self.ops.dtype_name(g))
                                 for position, g in self._recorded])
        pipeline = self.sparsifier_for(FUSED_KEY, layout)
        gradients = [g for _, g in self._recorded]
        if hasattr(pipeline, "step_sparse"):
            # A sparsifier's memory reads the gradients where they are (no fused copy).
            summed = pipeline.step_sparse([g.detach().reshape(-1) for g in gradients], tag=layout.tag)
        else:
            flat = self._buffer.fuse(layout, gradients)
            summed = pipeline.step(flat, tag=layout.tag)
            if not isinstance(summed, torch.Tensor):  # a pipeline that still runs on numpy
                summed = torch.from_numpy(summed).to(flat.device)
        return StepSum(layout, dict(self._recorded), summed)


#: the name it had when only sparsifiers used it
TorchSparseCompressor = TorchOutOfBandCompressor


class FusedBuffer:
    """One float32 buffer on the gradients' device, reused while the layout's length and
    the device stay the same (no allocation, no page faults per step)."""

    def __init__(self):
        self.flat = None

    def fuse(self, layout, gradients):
        device = gradients[0].device if gradients else torch.device("cpu")
        if self.flat is None or self.flat.numel() != layout.n or self.flat.device != device:
            self.flat = torch.empty(layout.n, dtype=torch.float32, device=device)
        for entry, g in zip(layout.entries, gradients):  # one copy pass, casting to float32
            self.flat[entry.offset:entry.offset + entry.size].copy_(g.detach().reshape(-1))
        return self.flat


class StepSum:
    """The step's sum over ranks, split by gradient: ``write(position, scale)`` puts one
    gradient's part, times ``scale``, into that gradient and returns it.

    summed : ``(indices, values)`` of a sparsifier (sorted int64 indices into the fused
        buffer and their float32 sums) or a dense float32 tensor of length n.
    """

    def __init__(self, layout, gradients, summed):
        self.gradients = gradients
        self.entries = {entry.key: entry for entry in layout.entries}
        self.sparse = isinstance(summed, tuple)
        if self.sparse:
            indices, values = summed
            # Where each gradient's pairs start and end: one binary search per gradient.
            offsets = torch.tensor([e.offset for e in layout.entries] + [layout.n],
                                   dtype=indices.dtype, device=indices.device)
            bounds = torch.searchsorted(indices, offsets).tolist()
            self.parts = {e.key: (indices[bounds[i]:bounds[i + 1]], values[bounds[i]:bounds[i + 1]])
                          for i, e in enumerate(layout.entries)}
        else:
            self.parts = {e.key: summed[e.offset:e.offset + e.size] for e in layout.entries}

    def write(self, position, scale):
        g, entry = self.gradients[position], self.entries[position]
        out = g if g.is_contiguous() and not g.requires_grad else torch.empty(
            entry.shape, dtype=g.dtype, device=g.device)
        flat_out = out.view(-1)
        if self.sparse:
            indices, values = self.parts[position]
            values = values * scale if scale != 1.0 else values
            flat_out.zero_()
            flat_out.index_copy_(0, (indices - entry.offset).to(out.device), values.to(out.device, out.dtype))
        else:
            part = self.parts[position]
            flat_out.copy_(part * scale if scale != 1.0 else part)
        return out
