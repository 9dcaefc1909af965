"""``randomk``: k random coordinates per tensor, the same k on every rank.

Every rank draws the same indices from ``(seed, slot stream, step)``
(:func:`horovod_sparse.ops.random_indices`), so the k gathered values of all ranks
line up and Horovod's dense allreduce of those k values is the exact sum of what
each rank kept. With error feedback (default) the coordinates not sent stay in a
residual and are added to the next step's gradient, so nothing is lost, only delayed.
Reference: Stich et al., "Sparsified SGD with memory", NeurIPS 2018; GRACE's randomk.

A loss scaler's overflow (:mod:`horovod_sparse.nonfinite`): a rank whose gradient (with its
residual) holds inf or NaN sends NaN, so the reduced payload is NaN on every rank; each rank
then returns NaN for the whole gradient and keeps its residual and step counter as they were.
The state is therefore committed in ``decompress``, on the reduced payload (k values, the same
on every rank), not in ``compress``; and a step in which any gradient overflowed is rolled back
whole when it is settled (:mod:`horovod_sparse.slots`), as the scaler skips it whole, so the
next step runs as if that one had never been.
"""
from typing import Any, NamedTuple

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

    def compress(self, ops, tensor, slot, in_place=False):
        dtype = ops.dtype_name(tensor)
        if not ops.is_float(tensor):
            return tensor, None
        shape, n = ops.shape(tensor), ops.numel(tensor)
        k = self.k_for(n)
        flat = to_wire(ops, ops.flatten(tensor))
        # drawn first: the fused CPU kernel gathers while it accumulates
        indices = ops.random_indices(self.seed, slot.stream, ops.read_step(slot), n, k, like=flat)
        # error feedback in horovod_sparse.memory's two phases: acc = grad + residual in a working
        # buffer, the k values gathered from it (NaN where acc overflowed: Horovod's sum is then
        # NaN on every rank, and every rank declines the step in decompress, no extra collective)
        # and acc zeroed there, the residual to commit; the slot changes only in decompress
        values, residual = ops.pick(slot, flat, indices, self.error_feedback)
        # with in_place (Horovod's optimizer: the gradient is not read again once compressed, and
        # becomes the result) decompress writes the result into the gradient. Not before: a
        # caller may still read it between compress and decompress
        return values, RandomKContext(indices, n, shape, dtype, tensor if in_place else None, slot, residual)

    def decompress(self, ops, payload, ctx):
        if ctx is None:
            return payload
        # the reduced payload is the same on every rank, so every rank decides the same
        finite = ops.all_finite(payload)
        dense = ops.scatter_into(ctx.gradient, ctx.indices, payload, ctx.n)
        dense = ops.commit_if(finite, ctx.slot, ctx.residual, ops.nan_unless(finite, dense))
        return ops.reshape(from_wire(ops, dense, ctx.dtype, ctx.gradient), ctx.shape)


class RandomKContext(NamedTuple):
    """What :meth:`RandomKCompressor.compress` hands to its ``decompress`` (``ctx[0]`` is the
    indices, as before the commit moved to ``decompress``)."""
    indices: Any      # the k sorted indices sent, on the gradient's device
    n: int            # the gradient's element count
    shape: tuple      # the gradient's shape
    dtype: str        # the gradient's dtype name
    gradient: Any     # the gradient, free to overwrite with the result (None: return a new tensor)
    slot: Any         # the gradient's Slot
    residual: Any     # the residual to commit (acc with zeros where sent); None without error feedback
