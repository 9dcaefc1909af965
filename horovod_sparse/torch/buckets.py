"""One exchange of some of a step's gradients, and its result written back into them.

A :class:`Bucket` is a set of gradients exchanged together by one pipeline: all of a
step's gradients (``schedule="after_backward"``, one exchange after backward) or one
bucket of a schedule's plan (:mod:`horovod_sparse.torch.channels`). Its pipeline's state
follows each gradient by key (:class:`~horovod_sparse.layout_pipeline.LayoutPipeline`), so
gradients can move between buckets (a new plan, a frozen layer) and keep their residuals.

    bucket = Bucket(horovod_sparse.create("topk", density=0.01))
    step_sum = bucket.exchange({"fc.weight": grad}, frozen={}, comm=comm, name="topk")
    step_sum.write("fc.weight", scale=0.5)        # the average, written into grad
"""
import torch

from horovod_sparse.agreement import agree_on_layout, raise_on_every_rank
from horovod_sparse.layout import GradientLayout, key_order  # noqa: F401 (key_order: for the schedules)
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.layout_pipeline import LayoutPipeline

FROZEN_WITH_GRADIENT = ("a frozen parameter (requires_grad False) has a non-zero gradient; frozen parameters "
                        "are not exchanged: zero their gradients (opt.zero_grad())")
OPS = TorchOps()


class Bucket:
    """Gradients exchanged together, with their pipeline, fused buffer and layout.

    keys: the bucket's gradient keys in the order they are laid out (the plan's order,
        the same on every rank), or None for "every gradient given, sorted by key".
    """

    def __init__(self, algorithm, keys=None):
        self.algorithm = algorithm
        self.keys = None if keys is None else list(keys)
        self.comm = None  # the communicator of the current exchange (pipelines are made on it)
        self.pipelines = LayoutPipeline(
            lambda layout: algorithm.make_pipeline(layout.n, self.comm, layout=layout))
        self.buffer = FusedBuffer()
        self._layout = None  # (items, GradientLayout) of the last exchange, reused while it fits

    def exchange(self, recorded, frozen, comm, name):
        """Exchange this bucket's gradients among ``recorded`` (key -> tensor) on ``comm``
        (collective); ``frozen`` (key -> zero gradient) are not exchanged. The ranks first
        agree on the layout, so ranks whose gradients differ fail together with a clear
        error. Returns the :class:`StepSum`."""
        if self.keys is None:
            keys = sorted(recorded, key=key_order)
            frozen_here = frozen
        else:
            keys = [k for k in self.keys if k in recorded]
            frozen_here = {k: frozen[k] for k in self.keys if k in frozen}
        gradients = [recorded[k] for k in keys]
        items = [(k, OPS.shape(g), OPS.dtype_name(g)) for k, g in zip(keys, gradients)]
        if self._layout is None or self._layout[0] != items:  # its offsets and tag are computed once
            self._layout = (items, GradientLayout(items))
        layout = self._layout[1]
        nonzero_frozen = any(bool(g.any()) for g in frozen_here.values())
        agree_on_layout(layout, comm, name, refused=nonzero_frozen, why=FROZEN_WITH_GRADIENT)  # before any collective
        if not layout.entries:  # every gradient of the bucket is frozen: nothing to exchange
            return StepSum(layout, {}, torch.zeros(0), frozen_here)
        self.comm = comm
        if self.pipelines.is_current(layout):
            pipeline = self.pipelines.pipeline
        else:  # a new pipeline takes the gradients' state: a rank that cannot fails on every rank
            pipeline, problem = None, None
            try:
                pipeline = self.pipelines.for_layout(layout)
            except ValueError as e:
                problem = f"{name}: {e}"
            raise_on_every_rank(comm, problem)
        if hasattr(pipeline, "step_sparse"):
            # A sparsifier's memory reads the gradients where they are (no fused copy).
            summed = pipeline.step_sparse([g.detach().reshape(-1) for g in gradients], tag=layout.tag)
        else:
            flat = self.buffer.fuse(layout, gradients)
            summed = pipeline.step(flat, tag=layout.tag)
            if not isinstance(summed, torch.Tensor):  # a pipeline that still runs on numpy
                summed = torch.from_numpy(summed).to(flat.device)
        return StepSum(layout, {k: recorded[k] for k in keys}, summed, frozen_here)

    @property
    def layout(self):
        return self.pipelines.layout

    @property
    def pipeline(self):
        return self.pipelines.pipeline

    def close(self):
        self.pipelines.close()


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
