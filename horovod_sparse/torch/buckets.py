"""PyTorch's side of a bucket's exchange: its gradients fused, and the result written back.

The exchange itself, the same for every frontend, is :class:`horovod_sparse.step.bucket.Bucket`;
:class:`TorchStepArrays` tells it how to read torch tensors, :class:`FusedBuffer` fuses them
for the pipelines that take one buffer, and :class:`StepSum` writes each gradient's part of
the sum back into the gradient tensor (:class:`NonFiniteSum`: NaN, where a gradient overflowed).

    bucket = Bucket(horovod_sparse.create("topk", density=0.01), TORCH_ARRAYS)
    step_sum = bucket.exchange({"fc.weight": grad}, frozen={}, comm=comm, name="topk")
    step_sum.write("fc.weight", scale=0.5)        # the average, written into grad
"""
import torch

from horovod_sparse.ops import cpu
from horovod_sparse.ops.cpu.cast import scatter_dense
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.ops.host import to_list
from horovod_sparse.ops.namespace import host_shortcut_allowed
from horovod_sparse.ops.torch_ops import TorchOps

OPS = TorchOps()


class TorchStepArrays:
    """The step runtime's view of torch tensors (:mod:`horovod_sparse.step.bucket`): what a
    :class:`~horovod_sparse.step.bucket.Bucket` asks of the gradients, and a :class:`StepSum`
    that writes its result back into them."""

    def describe(self, g):
        return OPS.shape(g), OPS.dtype_name(g)

    def numel(self, g):
        return g.numel()

    def flat(self, g):
        return g.detach().reshape(-1)

    def nonzero(self, g):
        return bool(g.any())

    def fused_buffer(self):
        return FusedBuffer()

    def step_sum(self, layout, gradients, summed, frozen, like):
        if summed is None:
            summed = torch.zeros(0)
        elif not isinstance(summed, (tuple, torch.Tensor)):  # a pipeline that still runs on numpy
            summed = torch.from_numpy(summed).to(like.device)
        return StepSum(layout, gradients, summed, frozen)

    def fused_copy(self, gradients):
        return torch.cat([g.detach().reshape(-1).float() for g in gradients])

    def copy(self, g):
        return g.detach().clone()


#: the step arrays of the PyTorch frontend
TORCH_ARRAYS = TorchStepArrays()


#: (device, P) -> P as a 0-d float32 tensor there: the divisor of :func:`probe_scale`
_DIVISORS = {}


def probe_scale(probe, size):
    """The factor turning the step's sum over ``size`` ranks into Horovod's result, from a
    gradient's reduced probe (1 on every rank: ``size`` summed, 1 averaged; pre/postscale
    factors included): 1/P (Average) or 1 (Sum). A Python float on the host's path, where
    reading a CPU tensor costs nothing; on a device the 0-d float32 tensor probe / P, computed
    there, so that no gradient's ``decompress`` waits for the device. float32's quotient of 1
    or P by P is the rounded double one (checked for every P up to 100,000), so the products
    are the host path's; another factor's may differ by one rounding. The divisor is a
    tensor: CUDA divides by a Python number as a product with its reciprocal."""
    if host_shortcut_allowed(probe):
        return float(probe.item()) / size
    key = (probe.device, size)
    if key not in _DIVISORS:
        _DIVISORS[key] = torch.full((), float(size), dtype=torch.float32, device=probe.device)
    return probe / _DIVISORS[key]  # shape (1,): broadcasts over a gradient's part


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
    gradient's part, times ``scale`` (:func:`probe_scale`: a float, or a 0-d tensor on the
    device, never read back), into that gradient and returns it.

    summed : ``(indices, values)`` of a sparsifier (sorted int64 indices into the fused
        buffer and their float32 sums) or a dense float32 tensor of length n.
    """

    def __init__(self, layout, gradients, summed, frozen=()):
        self.gradients = gradients
        self.frozen = frozen  # gradients of frozen parameters: zero on every rank (checked)
        self.entries = layout.by_key
        self.sparse = isinstance(summed, tuple)
        if self.sparse and not host_shortcut_allowed(summed[1]):
            # On a device, where each gradient's pairs start is a read-back: the pairs are
            # scattered into one dense buffer instead (two launches, no wait), and each write
            # is then a slice's product, the same float32 products and zeros as the pairs'.
            summed, self.sparse = _densified(layout.n, *summed), False
        if self.sparse:
            indices, self.values = summed
            # Where each gradient's pairs start and end: one binary search per gradient. The
            # indices stay the fused buffer's; write() places them at its gradient's offset.
            starts = torch.tensor(layout.starts, dtype=indices.dtype, device=indices.device)
            bounds = to_list(torch.searchsorted(indices, starts))
            self.parts = {e.key: (indices[bounds[i]:bounds[i + 1]], slice(bounds[i], bounds[i + 1]))
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
            if isinstance(scale, torch.Tensor):  # this gradient's pairs only (a cache would compare on the host)
                values = self.values[part] * scale
            else:
                if scale not in self._scaled:
                    self._scaled[scale] = self.values * scale
                values = self._scaled[scale][part]
            if cpu.enabled() and out.dtype == values.dtype == torch.float32 and host_shortcut_allowed(out) \
                    and host_shortcut_allowed(values):  # zeros and sums in one sequential pass
                scatter_dense(flat_out.numpy(), indices.numpy(), values.numpy(), entry.offset)
            else:
                flat_out.zero_()
                flat_out.index_copy_(0, (indices - entry.offset).to(out.device), values.to(out.device, out.dtype))
        else:
            part = self.parts[key]
            if not isinstance(scale, torch.Tensor) and scale == 1.0:
                flat_out.copy_(part)
            elif flat_out.dtype == part.dtype and flat_out.device == part.device:
                torch.mul(part, scale, out=flat_out)  # one pass, no temporary (the same float32 product)
            else:
                flat_out.copy_(part * scale)
        return out


def _densified(n, indices, values):
    """The sparse sum ``(indices, values)`` as a dense buffer of ``n`` entries (zero elsewhere)."""
    return torch.zeros(n, dtype=values.dtype, device=values.device).index_copy_(0, indices, values)


class NonFiniteSum:
    """The step's result when some rank's gradient overflowed (:mod:`horovod_sparse.nonfinite`):
    ``write(key, scale)`` fills that gradient with NaN in place, on every rank, so that a loss
    scaler sees the overflow and skips the step; a frozen parameter keeps its zero gradient."""

    def __init__(self, gradients, frozen=()):
        self.gradients, self.frozen = gradients, frozen

    def write(self, key, scale):
        if key in self.frozen:
            return self.frozen[key]
        g = self.gradients[key]
        out = g if g.is_contiguous() and not g.requires_grad else torch.empty_like(g)
        return out.fill_(float("nan"))


class FiniteCheck:
    """Whether every tensor given is finite (inf and NaN are not), each read once as it comes: a
    CPU tensor at once (:func:`~horovod_sparse.ops.finite.all_finite`), one on a GPU into a flag
    on its device, all of which :meth:`all` reads with one synchronisation."""

    def __init__(self):
        self.finite, self._flags = True, []

    def add(self, tensor):
        if not host_shortcut_allowed(tensor) or tensor.dtype == torch.bfloat16:  # (numpy has no bfloat16)
            self._flags.append(torch.isfinite(tensor).all())
        elif self.finite:  # one non-finite tensor decides it
            self.finite = all_finite(tensor.reshape(-1))

    def all(self):
        if self._flags:
            self.finite = self.finite and bool(torch.stack(self._flags).all())
            self._flags = []
        return self.finite
