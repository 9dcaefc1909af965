"""PyTorch implementation of :class:`ArrayOps` (CPU or CUDA tensors)."""
import torch

from horovod_sparse.ops.base import ArrayOps, random_indices


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

    def gather(self, flat, indices):
        return flat.index_select(0, indices)

    def scatter(self, indices, values, n):
        return torch.zeros(n, dtype=values.dtype, device=values.device).index_copy_(0, indices, values)

    def accumulate(self, slot, t):
        r = slot.residual
        if r.dtype != t.dtype or r.device != t.device:
            return t + r
        # the spare (the residual before the last commit, free once that step is settled) is
        # taken: the commit swaps it in, and a second compress before it gets its own buffer
        spare, slot.spare = slot.spare, None
        if spare is None or spare.shape != r.shape:
            spare = torch.empty_like(r)
        return torch.add(t, r, out=spare)  # t + r and r + t are the same IEEE sums: bitwise the oracle's

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
        if t.device.type != "cpu" or t.dtype == torch.bfloat16:  # numpy has no bfloat16 view
            return torch.isfinite(t).all()
        return super().all_finite(t)

    def nan_unless(self, flag, t):
        if isinstance(flag, torch.Tensor):
            return t.masked_fill_(flag.logical_not(), float("nan"))
        return super().nan_unless(flag, t)

    def fill_nan_(self, t):
        return t.fill_(float("nan"))

    def scatter_into(self, out, indices, values, n):
        if (out is None or out.numel() != n or out.dtype != values.dtype or out.device != values.device
                or not out.is_contiguous() or out.requires_grad):
            return self.scatter(indices, values, n)
        return out.view(-1).zero_().index_copy_(0, indices, values)

    def random_indices(self, seed, stream, step, n, k, like=None):
        indices = torch.from_numpy(random_indices(seed, stream, step, n, k))
        return indices if like is None else indices.to(like.device, non_blocking=True)

    def to_numpy(self, t):
        return t.detach().cpu().numpy()

    def from_numpy(self, a, like=None):
        t = torch.from_numpy(a.copy())
        return t if like is None else t.to(device=like.device, dtype=like.dtype)
