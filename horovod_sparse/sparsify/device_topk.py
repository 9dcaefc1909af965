"""The exact top-k of :func:`~horovod_sparse.sparsify.selection.top_k` on a device, without a
read-back: every answer the host's branches need stays a 0-d tensor there.

The host's top-k tries its carried floor, then a sampled floor, then a full partition, and reads
each count back to choose (on a GPU a wait each: 9 of top-k's 11 host synchronisations a step).
Here all three are computed and the branch is chosen by ``torch.where``; the selection is exactly
``k`` entries, so its indices come from ``nonzero_static`` (a fixed size, no count to read). What
comes out is the host's, bit for bit: the same indices (the k largest keys, ties to the lower
index), the same k-th key, the same next floor and the same source, as device tensors:

* ``floor``: an int64 key, ``NO_FLOOR`` where the host has None;
* ``source``: ``SOURCES.index`` of the host's ``"floor"``, ``"sample"`` or ``"full"``.

Why the same: the candidates of every branch are all keys at or above its floor, at least ``k``
of them, so their k-th (and ``ceil(CANDIDATE_TARGET * k)``-th) largest are the buffer's, and
when fewer than that target their smallest is the buffer's ``count``-th largest: one ``topk`` of
the buffer's largest keys answers them all.

Example (under the device path)::

    found = device_top_k(keys, k, floor)     # floor: None, a Python int or a 0-d tensor
    found.indices                            # k sorted int64 indices, on the device
"""
import math
import sys

from horovod_sparse.ops.magnitude import kth_largest_on_device

#: the host's sources, by code
SOURCES = ("floor", "sample", "full")
#: the floor key where the host has none (keys are never negative: their sign is cleared)
NO_FLOOR = -1


def device_top_k(keys, k, floor, limits):
    """``(indices, kth, next_floor, source)`` as :func:`~horovod_sparse.sparsify.selection.top_k`
    gives them for ``keys`` (a :class:`~horovod_sparse.sparsify.selection.MagnitudeKeys` of a
    torch buffer) and ``1 <= k < n``, as device tensors. ``limits``: the host's constants
    ``(candidate_limit, (comfort_low, comfort_high), candidate_target, floor_margin, floor_sample)``."""
    torch = sys.modules["torch"]  # (loaded: keys are torch's; the package runs without it)
    limit, (low, high), target_factor, margin, floor_sample = limits
    all_keys, n = keys.keys, keys.size
    target = math.ceil(target_factor * k)
    largest = torch.topk(all_keys, min(n, target)).values  # descending
    kth = largest[k - 1]

    def in_range(candidate_floor):  # (whether it gives k to limit * k candidates, that count)
        count = (all_keys >= candidate_floor).sum()
        return (count >= k) & (count <= limit * k), count

    sample = keys.strided(0, -(-n // floor_sample))
    size = int(sample.shape[0])
    sampled = kth_largest_on_device(sample, min(size, math.ceil(target_factor * k * size / n)))
    sample_ok, _ = in_range(sampled)
    if floor is None:
        floor, floor_ok = torch.full((), NO_FLOOR, dtype=torch.int64, device=kth.device), False
    else:
        if not isinstance(floor, torch.Tensor):  # (a fill: no copy from the host)
            floor = torch.full((), floor, dtype=torch.int64, device=kth.device)
        floor_ok, _ = in_range(floor)
        floor_ok = floor_ok & (floor >= 0)
    chosen = torch.where(sample_ok, sampled.to(torch.int64), kth.to(torch.int64))
    source = torch.where(sample_ok, 1, 2)
    if floor_ok is not False:
        chosen, source = torch.where(floor_ok, floor, chosen), torch.where(floor_ok, 0, source)
    count = (all_keys >= chosen).sum()
    # (indexed by a tensor: a 0-d index in Python's brackets is read back)
    smallest = torch.index_select(largest, 0, (count - 1).clamp(max=largest.shape[0] - 1).view(1)).view(())
    next_floor = _lowered(smallest, margin)
    if target <= n:
        next_floor = torch.where(count >= target, largest[target - 1].to(torch.int64), next_floor)
    if floor_ok is not False:
        keep = floor_ok & (count >= math.ceil(low * k)) & (count <= math.floor(high * k))
        next_floor = torch.where(keep, floor, next_floor)
    return top_indices(all_keys, kth, k), kth, next_floor, source


def top_indices(all_keys, kth, k):
    """The sorted int64 indices of the ``k`` largest of the 1-D ``all_keys`` (a torch tensor),
    ties to the lower index, given ``kth``, their k-th largest (a 0-d tensor): nothing read back."""
    torch = sys.modules["torch"]
    above, ties = all_keys > kth, all_keys == kth
    taken = above | (ties & (ties.cumsum(0) <= k - above.sum()))
    return torch.nonzero_static(taken, size=k).view(-1)


def _lowered(key, margin):
    """:func:`~horovod_sparse.sparsify.selection._lowered` on a 0-d int32 key: the key ``margin``
    below its magnitude (float64 quotient rounded to float32), ``NO_FLOOR`` for NaN."""
    torch = sys.modules["torch"]
    magnitude = key.view(torch.float32).to(torch.float64)
    # divided by a tensor: CUDA divides by a Python number as a product with its reciprocal
    lowered = (magnitude / torch.full((), margin, dtype=torch.float64, device=key.device)).to(torch.float32)
    return torch.where(torch.isnan(magnitude), NO_FLOOR, lowered.view(torch.int32).to(torch.int64))
