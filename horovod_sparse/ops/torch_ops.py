"""PyTorch implementation of :class:`ArrayOps` (CPU or CUDA tensors).

Buffer reuse (the in-band compressors' round trip at memory speed): the payload is written
into the slot's wire buffer (:meth:`TorchOps.cast_to_wire`) and the result into the gradient
itself (:meth:`TorchOps.cast_back`, :meth:`TorchOps.scatter_into`), as Horovod's optimizer
reduces the payload in place and makes the result the gradient (``p.grad.set_(...)``). Only
plain tensors: one that requires grad (autograd must see a new tensor), a view (its base would
change too), a non-contiguous or inference tensor, or a call traced by ``torch.compile`` gets
new tensors, as before. Whether the gradient may be written at all is the frontend's call
(:meth:`horovod_sparse.in_band.InBandCompressorBase.compress_slot`).
"""
import torch

from horovod_sparse.ops import cpu
from horovod_sparse.ops.base import ArrayOps, random_indices
from horovod_sparse.ops.namespace import host_shortcut_allowed

#: dtypes random-k's fused CPU kernels run on (:mod:`horovod_sparse.ops.cpu.cast`)
_KERNEL_DTYPES = (torch.float32, torch.float64)


class TorchOps(ArrayOps):
    name = "torch"

    def dtype_name(self, t):
        return str(t.dtype).replace("torch.", "")

    def shape(self, t):
        return tuple(int(d) for d in t.shape)

    def cast(self, t, dtype_name):
        return t.to(getattr(torch, dtype_name))

    def reshape(self, t, shape):
        return t.reshape(shape)

    def zeros(self, shape, dtype_name, like=None):
        return torch.zeros(shape, dtype=getattr(torch, dtype_name),
                           device=None if like is None else like.device)

    def cast_to_wire(self, t, dtype_name, slot=None):
        dtype = getattr(torch, dtype_name)
        if slot is None or t.requires_grad or _compiling():
            return self.cast(t, dtype_name)
        wire = slot.wire
        if wire is None or wire.shape != t.shape or wire.dtype != dtype or wire.device != t.device:
            wire = slot.wire = torch.empty(t.shape, dtype=dtype, device=t.device)
        return wire.copy_(t)  # torch's rounding (nearest even), the bits of t.to(dtype)

    def cast_back(self, t, dtype_name, out=None):
        if out is None or not writable(out, t.numel(), getattr(torch, dtype_name), t.device):
            return self.cast(t, dtype_name)
        return out.copy_(t.reshape(out.shape))

    def gather(self, flat, indices):
        return flat.index_select(0, indices)

    def scatter(self, indices, values, n):
        return torch.zeros(n, dtype=values.dtype, device=values.device).index_copy_(0, indices, values)

    def accumulate(self, slot, t):
        r = slot.residual
        if r.dtype != t.dtype or r.device != t.device:
            return t + r
        spare = self._take_spare(slot)
        return torch.add(t, r, out=spare)  # t + r and r + t are the same IEEE sums: bitwise the oracle's

    def pick(self, slot, flat, indices, error_feedback=True):
        r = slot.residual
        if not (error_feedback and self._fuses(flat, indices) and r.dtype == flat.dtype and r.device == flat.device):
            return super().pick(slot, flat, indices, error_feedback)
        from horovod_sparse.ops.cpu.cast import accumulate_pick
        acc = self._take_spare(slot)
        values = torch.empty(indices.numel(), dtype=flat.dtype)
        bad = accumulate_pick(flat.detach().numpy(), r.numpy(), acc.numpy(), indices.numpy(), values.numpy())
        return (values if bad == 0 else values.fill_(float("nan"))), acc

    @staticmethod
    def _fuses(flat, indices):
        """Whether random-k's compiled CPU kernels take these buffers (else torch's ops)."""
        return (cpu.enabled() and host_shortcut_allowed(flat) and flat.dtype in _KERNEL_DTYPES
                and flat.is_contiguous() and not flat.requires_grad and not _compiling()
                and host_shortcut_allowed(indices) and indices.dtype == torch.int64)

    @staticmethod
    def _take_spare(slot):
        """The slot's spare buffer (the residual before the last commit, free once that step is
        settled), taken: the commit swaps it in, and a second compress before it gets its own."""
        r = slot.residual
        spare, slot.spare = slot.spare, None
        if spare is None or spare.shape != r.shape or spare.dtype != r.dtype or spare.device != r.device:
            spare = torch.empty_like(r)
        return spare

    def release_residual(self, slot, residual):
        if residual is not None and slot.spare is None and self._fits(slot, residual):
            slot.spare = residual

    @staticmethod
    def _fits(slot, buffer):
        r = slot.residual
        return buffer is not r and buffer.shape == r.shape and buffer.dtype == r.dtype and buffer.device == r.device

    def all_finite(self, t):
        # on a GPU a 0-d bool tensor: compress runs in Horovod's backward hooks, where a
        # synchronisation would hold back the backward pass (decompress's commit reads it)
        if not host_shortcut_allowed(t) or t.dtype == torch.bfloat16:  # numpy has no bfloat16 view
            return torch.isfinite(t).all()
        return super().all_finite(t)

    def nan_unless(self, flag, t):
        if isinstance(flag, torch.Tensor):
            return t.masked_fill_(flag.logical_not(), float("nan"))
        return super().nan_unless(flag, t)

    def fill_nan_(self, t):
        return t.fill_(float("nan"))

    def scatter_into(self, out, indices, values, n):
        if out is None or not writable(out, n, values.dtype, values.device):
            return self.scatter(indices, values, n)
        flat = out.view(-1)
        if self._fuses(flat, indices) and values.is_contiguous():
            from horovod_sparse.ops.cpu.cast import scatter_dense
            scatter_dense(flat.numpy(), indices.numpy(), values.detach().numpy())
            return flat
        return flat.zero_().index_copy_(0, indices, values)

    def random_indices(self, seed, stream, step, n, k, like=None):
        indices = torch.from_numpy(random_indices(seed, stream, step, n, k))
        return indices if like is None else indices.to(like.device, non_blocking=True)

    def to_numpy(self, t):
        return t.detach().cpu().numpy()

    def from_numpy(self, a, like=None):
        t = torch.from_numpy(a.copy())
        return t if like is None else t.to(device=like.device, dtype=like.dtype)


def writable(out, n, dtype, device):
    """Whether a result of ``n`` elements of ``dtype`` on ``device`` may be written into ``out``
    (a gradient the frontend handed over): a plain contiguous tensor of that size and dtype, not
    a view (its base would change too), not one autograd tracks, not an inference tensor outside
    inference mode (torch refuses to write it), not inside a ``torch.compile`` trace."""
    return (out.numel() == n and out.dtype == dtype and out.device == device and out.is_contiguous()
            and not out.requires_grad and not out._is_view() and not _compiling()
            and (not out.is_inference() or torch.is_inference_mode_enabled()))


def _compiling():
    """Whether torch.compile (dynamo) is tracing this call: buffers must not be mutated there."""
    compiler = getattr(torch, "compiler", None)
    return bool(compiler is not None and compiler.is_compiling())
