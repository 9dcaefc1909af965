"""One exchange of some of a step's gradients, whatever framework holds them.

A :class:`Bucket` is a set of gradients exchanged together by one pipeline: all of a
step's gradients (``schedule="after_backward"``, one exchange after backward) or one
bucket of a schedule's plan (:mod:`horovod_sparse.step.channels`). Its pipeline's state
follows each gradient by key (:class:`~horovod_sparse.layout_pipeline.LayoutPipeline`), so
gradients can move between buckets (a new plan, a frozen layer) and keep their residuals.

What the framework's arrays need is a frontend's *step arrays* object (PyTorch:
:class:`horovod_sparse.torch.buckets.TorchStepArrays`; TensorFlow's host call:
:class:`horovod_sparse.tensorflow.step_arrays.HostStepArrays`), with:

- ``describe(g)`` -> ``(shape, dtype name)``; ``numel(g)``; ``flat(g)``: a 1-D view;
  ``nonzero(g)``: any element non-zero;
- ``fused_buffer()``: an object whose ``fuse(layout, gradients)`` returns them as one float32
  buffer (reused from step to step), for the pipelines that take neither pieces
  (``takes_pieces``) nor ``step_sparse``;
- ``step_sum(layout, gradients, summed, frozen, like)``: the result handed back to the
  frontend (``summed``: a sparsifier's ``(indices, values)``, a dense sum, or None when
  every gradient of the bucket is frozen; ``like``: the fused buffer or the first piece, or
  None);
- ``fused_copy(gradients)`` and ``copy(g)``: float32 copies for the cost probes
  (:mod:`horovod_sparse.step.profiling`).

    bucket = Bucket(horovod_sparse.create("topk", density=0.01), TorchStepArrays())
    step_sum = bucket.exchange({"fc.weight": grad}, frozen={}, comm=comm, name="topk")
    step_sum.write("fc.weight", scale=0.5)        # PyTorch: the average, written into grad
"""
from horovod_sparse.agreement import agree_on_layout
from horovod_sparse.layout import GradientLayout, key_order  # noqa: F401 (key_order: for the schedules)
from horovod_sparse.layout_pipeline import LayoutPipeline

FROZEN_WITH_GRADIENT = ("a frozen parameter (requires_grad False) has a non-zero gradient; frozen parameters "
                        "are not exchanged: zero their gradients (opt.zero_grad())")


class Bucket:
    """Gradients exchanged together, with their pipeline, fused buffer and layout.

    arrays: the frontend's step arrays (module docstring).
    keys: the bucket's gradient keys in the order they are laid out (the plan's order,
        the same on every rank), or None for "every gradient given, sorted by key".
    """

    def __init__(self, algorithm, arrays, keys=None):
        self.algorithm, self.arrays = algorithm, arrays
        self.keys = None if keys is None else list(keys)
        self.comm = None  # the communicator of the current exchange (pipelines are made on it)
        self.pipelines = LayoutPipeline(
            lambda layout: algorithm.make_pipeline(layout.n, self.comm, layout=layout))
        self.buffer = arrays.fused_buffer()
        self._layout = None  # (items, GradientLayout) of the last exchange, reused while it fits

    def exchange(self, recorded, frozen, comm, name, finite=True):
        """Exchange this bucket's gradients among ``recorded`` (key -> array) on ``comm``
        (collective); ``frozen`` (key -> zero gradient) are not exchanged. The ranks first
        agree on the layout, so ranks whose gradients differ fail together with a clear
        error. ``finite=False``: another gradient of this rank's step overflowed (every rank
        then raises NonFiniteGradientError, as for an overflow here). Returns the frontend's
        step sum."""
        if self.keys is None:
            keys = sorted(recorded, key=key_order)
            frozen_here = frozen
        else:
            keys = [k for k in self.keys if k in recorded]
            frozen_here = {k: frozen[k] for k in self.keys if k in frozen}
        arrays = self.arrays
        gradients = [recorded[k] for k in keys]
        items = [(k, *arrays.describe(g)) for k, g in zip(keys, gradients)]
        if self._layout is None or self._layout[0] != items:  # its offsets and tag are computed once
            self._layout = (items, GradientLayout(items))
        layout = self._layout[1]
        nonzero_frozen = any(arrays.nonzero(g) for g in frozen_here.values())
        agree_on_layout(layout, comm, name, refused=nonzero_frozen, why=FROZEN_WITH_GRADIENT)  # before any collective
        if not layout.entries:  # every gradient of the bucket is frozen: nothing to exchange
            return arrays.step_sum(layout, {}, None, frozen_here, like=None)
        self.comm = comm
        pipeline = self.pipelines.for_layout_on_every_rank(layout, comm, name)
        if hasattr(pipeline, "step_sparse") or pipeline.takes_pieces:
            # The pipeline's memory reads the gradients where they are (no fused copy).
            pieces = [arrays.flat(g) for g in gradients]
            step = pipeline.step_sparse if hasattr(pipeline, "step_sparse") else pipeline.step
            summed, like = step(pieces, tag=layout.tag, finite=finite), pieces[0]
        else:
            like = self.buffer.fuse(layout, gradients)
            summed = pipeline.step(like, tag=layout.tag, finite=finite)
        return arrays.step_sum(layout, {k: recorded[k] for k in keys}, summed, frozen_here, like=like)

    @property
    def layout(self):
        return self.pipelines.layout

    @property
    def pipeline(self):
        return self.pipelines.pipeline

    def close(self):
        self.pipelines.close()
