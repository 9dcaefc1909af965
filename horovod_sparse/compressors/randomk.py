"""``randomk``: k random coordinates per tensor, the same k on every rank.

Every rank draws the same indices from ``(seed, slot stream, step)``
(:func:`horovod_sparse.ops.random_indices`), so the k gathered values of all ranks
line up and Horovod's dense allreduce of those k values is the exact sum of what
each rank kept. With error feedback (default) the coordinates not sent stay in a
residual and are added to the next step's gradient, so nothing is lost, only delayed.
Reference: Stich et al., "Sparsified SGD with memory", NeurIPS 2018; GRACE's randomk.
"""
from horovod_sparse.compressors.base import Compressor, check_bool, check_fraction, check_nonnegative_int
from horovod_sparse.compressors.cast import from_wire, to_wire
from horovod_sparse.sparsify.selection import k_for


class RandomKCompressor(Compressor):
    """Random-k sparsification carried by Horovod's allreduce.

    Args:
        density: fraction of each tensor's elements sent per step, in (0, 1].
            k = ceil(density * n), at least 1 for a non-empty tensor.
        error_feedback: keep what was not sent in a residual and add it back next step.
        seed: base of the shared random stream; must be equal on all ranks.

    Payload per tensor: k values of the gradient's dtype (bfloat16 as float32); the
    indices are never sent.
    """

    name = "randomk"
    stateful = True

    def __init__(self, density=0.01, error_feedback=True, seed=0):
        super().__init__()
        self.density = check_fraction("density", density)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.seed = check_nonnegative_int("seed", seed, upper=2**32 - 1)
        self.params = dict(density=self.density, error_feedback=self.error_feedback, seed=self.seed)

    def k_for(self, n):
        """Number of elements sent for a tensor of ``n`` elements."""
        return k_for(self.density, n)

    def compress(self, ops, tensor, slot):
        dtype = ops.dtype_name(tensor)
        if not ops.is_float(tensor):
            return tensor, None
        shape, n = ops.shape(tensor), ops.numel(tensor)
        k = self.k_for(n)
        acc = to_wire(ops, ops.flatten(tensor))
        # error feedback (horovod_sparse.memory): acc = grad + residual, in place where the
        # framework allows; committed at once, as the exchange (Horovod's) comes after
        if self.error_feedback:
            acc = ops.add_to_residual(slot, acc)
        indices = ops.random_indices(self.seed, slot.stream, ops.read_step(slot), n, k, like=acc)
        values = ops.gather(acc, indices)
        if self.error_feedback:
            ops.write_residual(slot, ops.zero_at_(acc, indices))
        ops.advance_step(slot)
        # decompress may write the result into the gradient it was given (as Horovod's own
        # allreduce does): it is not read again once compressed
        return values, (indices, n, shape, dtype, tensor)

    def decompress(self, ops, payload, ctx):
        if ctx is None:
            return payload
        indices, n, shape, dtype, gradient = ctx
        dense = from_wire(ops, ops.scatter_into(gradient, indices, payload, n), dtype)
        return ops.reshape(dense, shape)
