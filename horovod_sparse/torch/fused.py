"""The PyTorch out-of-band compressor: one fused exchange per step, behind the stock
``hvd.DistributedOptimizer``, for the compressors Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT).

Horovod calls ``compress`` for every gradient of a step (from the backward hooks and
``synchronize()``) before the step's first ``decompress``. So:

1. ``compress`` records the gradient under its parameter's name (read from the calling
   Horovod code; its position in the step where no name is visible) and hands Horovod a
   one-element probe (its reduced value gives the Average/Sum scale,
   :mod:`horovod_sparse.sparse_adapter`);
2. the step's first ``decompress`` runs the pipeline on the recorded gradients, ordered by
   name (Horovod compresses the gradients missing from the backward pass in
   ``synchronize()``, in an order that differs between steps and ranks), as one buffer: a
   sparsifier gets them as pieces of it (its memory reads them in place: grad + residual
   in one pass), the other pipelines a copy in one persistent float32 buffer on their
   device (:class:`FusedBuffer`). One exchange per step, on the ranks of the optimizer's
   process set; the ranks first agree on the layout (one 8-byte Allgather), so ranks
   whose gradients differ fail together with a clear error;
3. each ``decompress`` writes its gradient's part of the sum into the gradient tensor
   itself (zeroed, then the summed pairs scattered in for sparsifiers; copied from the
   dense sum for the others), scaled by its probe, and returns it - in place, as
   Horovod's own allreduce does. Only the pipeline's payload ever leaves the device.

A frozen parameter (``requires_grad`` False, as in fine-tuning schedules) leaves the fused
layout at the step it is frozen on every rank: its residual is kept aside, untouched, and
restored when it is unfrozen (:mod:`horovod_sparse.regroup`), never drained into a frozen
parameter. Horovod still reduces its gradient, which it zero-fills: it gets a probe like
the others (so Horovod's payloads never differ across ranks, whatever a rank froze) and a
zero result; a non-zero gradient on a frozen parameter is refused on every rank.
"""
import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from horovod_sparse.horovod_checks import caller_gradient, caller_process_set, check_caller, communicator_of
from horovod_sparse.layout import GradientLayout, agree_on_layout
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.regroup import LayoutPipeline
from horovod_sparse.sparse_adapter import SparseCompressorBase

FUSED_KEY = "fused"


class TorchOutOfBandCompressor(SparseCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` that exchanges the fused step out of band.

    Args:
        algorithm: a fused compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.

    The fused buffer is float32 on the gradients' device; results are written back in each
    gradient's own dtype and device. Use one instance per optimizer (with ``process_set=``,
    the exchange runs among that set's ranks). ``state_dict()`` is keyed by parameter name.

    Example::

        compression = TorchOutOfBandCompressor(horovod_sparse.create("topk", density=0.01))
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    """

    ops = TorchOps()

    def __init__(self, algorithm, dense_below=None):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self._position = 0
        self._step_finished = False
        self._recorded = {}    # key -> gradient, this step
        self._frozen = {}      # key -> gradient of a frozen parameter, this step
        self._results = None   # the step's StepSum, after its exchange
        self._buffer = FusedBuffer()
        self._layout = None    # the last step's layout, reused while the gradients keep it
        self._caller_checked = False
        self._pipelines = LayoutPipeline(
            lambda layout: self.algorithm.make_sparsifier(layout.n, self.comm, layout=layout))

    def compress(self, tensor):
        if self._step_finished:
            self._position, self._step_finished = 0, False
            self._recorded, self._frozen, self._results = {}, {}, None
        if not self._caller_checked:
            check_caller(self.algorithm.name, hvd.Adasum, _DistributedAdasumOptimizer._allreduce_grad_async.__code__,
                         process_sets=True)
            self._comm = communicator_of(caller_process_set())
            self._caller_checked = True
        name, parameter = caller_gradient(tensor)
        key = self._position if name is None else name
        self._position += 1
        if self.goes_dense(tensor):
            return self.compress_dense(tensor, key)
        if key in self._recorded or key in self._frozen:
            raise ValueError(f"{self.algorithm.name}: gradient {key!r} was compressed twice in one step "
                             "(one compressor instance per optimizer, one name per tensor)")
        frozen = parameter is not None and not parameter.requires_grad
        (self._frozen if frozen else self._recorded)[key] = tensor
        probe = torch.ones(1, dtype=torch.float32, device=tensor.device)
        self.record(key, tensor, probe)
        return probe, ("sparse", key)

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
        """Fuse the recorded gradients, ordered by key, and run the step's one exchange."""
        keys = sorted(self._recorded, key=lambda key: (isinstance(key, str), key))
        gradients = [self._recorded[key] for key in keys]
        items = [(key, tuple(g.shape), self.ops.dtype_name(g)) for key, g in zip(keys, gradients)]
        if self._layout is None or self._layout[0] != items:  # its offsets and tag are computed once
            self._layout = (items, GradientLayout(items))
        layout = self._layout[1]
        nonzero_frozen = any(bool(g.any()) for g in self._frozen.values())
        agree_on_layout(layout, self.comm, self.algorithm.name, refused=nonzero_frozen,  # before any
                        why="a frozen parameter (requires_grad False) has a non-zero gradient; "  # collective
                            "frozen parameters are not exchanged: zero their gradients (opt.zero_grad())")
        if not layout.entries:  # every gradient of the step is frozen: nothing to exchange
            return StepSum(layout, {}, torch.zeros(0), self._frozen)
        pipeline = self._pipelines.for_layout(layout)
        self.sparsifiers = {FUSED_KEY: (layout, pipeline)}
        if hasattr(pipeline, "step_sparse"):
            # A sparsifier's memory reads the gradients where they are (no fused copy).
            summed = pipeline.step_sparse([g.detach().reshape(-1) for g in gradients], tag=layout.tag)
        else:
            flat = self._buffer.fuse(layout, gradients)
            summed = pipeline.step(flat, tag=layout.tag)
            if not isinstance(summed, torch.Tensor):  # a pipeline that still runs on numpy
                summed = torch.from_numpy(summed).to(flat.device)
        return StepSum(layout, self._recorded, summed, self._frozen)

    # -- checkpointing: by gradient key, so that state follows its parameter ------------
    def state_dict(self):
        """``{parameter name: {field: its slice of the residual...}}`` plus the fused pipeline's
        whole-buffer state under ``"(fused)"`` (numpy arrays and ints); each rank saves its own."""
        return self._pipelines.state_dict()

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`, now or at the first step; a gradient's state goes back to
        it by name, whatever the layout then."""
        self._pipelines.load_state_dict(state_dict)

    def close(self):
        self._pipelines.close()


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
    """The step's sum over ranks, split by gradient: ``write(key, scale)`` puts one
    gradient's part, times ``scale``, into that gradient and returns it.

    summed : ``(indices, values)`` of a sparsifier (sorted int64 indices into the fused
        buffer and their float32 sums) or a dense float32 tensor of length n.
    """

    def __init__(self, layout, gradients, summed, frozen=()):
        self.gradients = gradients
        self.frozen = frozen  # gradients of frozen parameters: zero on every rank (checked)
        self.entries = layout.by_key
        self.sparse = isinstance(summed, tuple)
        if self.sparse:
            indices, self.values = summed
            # Where each gradient's pairs start and end (one binary search per gradient), and
            # every index made relative to its gradient in one op over all of them.
            starts = torch.tensor(layout.starts, dtype=indices.dtype, device=indices.device)
            ends = torch.searchsorted(indices, starts)
            local = indices - torch.repeat_interleave(starts[:-1], ends.diff())
            bounds = ends.tolist()
            self.parts = {e.key: (local[bounds[i]:bounds[i + 1]], slice(bounds[i], bounds[i + 1]))
                          for i, e in enumerate(layout.entries)}
            self._scaled = {1.0: self.values}  # scale -> values * scale: once per step, not per gradient
        else:
            self.parts = {e.key: summed[e.offset:e.offset + e.size] for e in layout.entries}

    def write(self, key, scale):
        if key in self.frozen:
            return self.frozen[key]
        g, entry = self.gradients[key], self.entries[key]
        out = g if g.is_contiguous() and not g.requires_grad else torch.empty(
            entry.shape, dtype=g.dtype, device=g.device)
        flat_out = out.view(-1)
        if self.sparse:
            indices, part = self.parts[key]
            if scale not in self._scaled:
                self._scaled[scale] = self.values * scale
            flat_out.zero_()
            flat_out.index_copy_(0, indices.to(out.device), self._scaled[scale][part].to(out.device, out.dtype))
        else:
            part = self.parts[key]
            flat_out.copy_(part * scale if scale != 1.0 else part)
        return out
