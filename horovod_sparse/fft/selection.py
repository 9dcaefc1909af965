"""Exact top-k of the coefficients' energy keys, most steps without looking at all of them.

The FFT compressor keeps exactly the k coefficients of largest energy, ties to the lower
position. A full selection (one partition of all C keys, ~76 ms for 14.7M keys here) is
the step's most expensive part after the transforms, yet the energies move little from
step to step. So :class:`TopCoefficients` carries a *candidate bound* across steps:

1. count the keys >= bound (one comparison pass, writing a mask);
2. if at least k pass, compact them (sorted positions) and select among those
   candidates only; else (first step, or the energies fell) select among all keys;
3. the selection: the k-th largest key (a partition of the pool), every key above it,
   and the first (lowest-position) keys equal to it until k are taken;
4. the next bound: the key ranked ``ceil(slack * k)`` in the pool (found by the same
   partition as step 3's), so next step's candidates are about ``slack * k`` if the
   energies keep their distribution.

Every coefficient at or above the k-th largest key is a candidate whenever at least k
are, so the result is the exact top-k whatever the bound: the bound only decides how
much work a step does, never what it selects (so it is not part of any checkpoint, and
numpy and torch select the same from the same keys). TensorFlow tensors (the step as
TensorFlow ops on the gradient's device) run the same steps through the kernels' TensorFlow
spellings, which return new tensors (so the code below always uses what a kernel returns).
"""
import math

from horovod_sparse.ops import indices, kernels, magnitude, namespace
from horovod_sparse.ops.views import numpy_view
from horovod_sparse.sparsify.device_topk import top_indices


class TopCoefficients:
    """Exact top-k of int32 keys with a candidate bound carried across calls (see the
    module docstring). ``slack`` > 1: the candidates aimed at, in multiples of k."""

    def __init__(self, slack=1.5):
        self.slack = float(slack)
        self.bound = None

    def select(self, keys, k, mask):
        """Sorted int64 positions of the ``k`` largest ``keys`` (1-D int32), ties to the
        lower position, in keys' library; ``mask``: a bool buffer like ``keys`` (scratch; None
        on TensorFlow)."""
        size = int(keys.shape[0])
        if k >= size:
            return namespace.arange(size, keys)
        if k <= 0:
            return namespace.empty(0, "int64", keys)
        if namespace.is_torch(keys) and numpy_view(keys) is None:  # a device: no bound, nothing read back
            return top_indices(keys, magnitude.kth_largest_on_device(keys, k), k)
        candidates = None                                                           # step 1
        if self.bound is not None:
            mask, count = kernels.mark_at_least(keys, self.bound, mask)
            if count >= k:
                candidates = indices.compact(mask)                                  # step 2
        pool = keys if candidates is None else indices.take(keys, candidates)
        pool_size = int(pool.shape[0])                                              # steps 3, 4
        kth, self.bound = magnitude.kth_largests(pool, [k, min(pool_size, math.ceil(self.slack * k))])
        chosen = pool > kth
        above = indices.count_nonzero(chosen)
        if above < k:
            chosen = kernels.set_true_at(chosen, indices.flatnonzero(pool == kth)[:k - above])
        picked = indices.flatnonzero(chosen)
        return picked if candidates is None else indices.take(candidates, picked)
