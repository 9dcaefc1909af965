"""A sparsifier step's first pass over the gradient: what to compress, whether it is finite,
and the candidates of the selection.

Two spellings of the same result:

* :func:`first_pass`, fused (:mod:`horovod_sparse.ops.cpu.sparsify`, numba), where
  :func:`fusable` holds: float32 gradients on the CPU
  (numpy, or torch tensors through zero-copy views) with error feedback or DGC's momentum
  correction: acc is written, its inf and NaN counted, and every entry whose magnitude key
  reaches the rule's candidate floor collected (index and key), in the one pass error
  feedback needs anyway;
* otherwise the sparsifier runs the memory's own passes (:mod:`horovod_sparse.memory`), then
  :func:`~horovod_sparse.ops.finite.all_finite`; no candidates: the rule computes the keys
  (:class:`~horovod_sparse.sparsify.selection.MagnitudeKeys`).

The selection is the same either way: candidates only answer, in O(candidates), the
questions the keys would have answered in a pass ("which entries reach this key?"); a
question they cannot answer (a key below their floor, or more entries than the buffers
hold) costs one read pass of acc (:func:`rescan`) instead of numpy's keys, mask and
compaction.

Example::

    if fusable(memory, pieces):
        acc, finite, candidates = first_pass(memory, pieces, rule.candidate_floor(), scratch)
"""
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_sparse.memory import ErrorFeedback, MomentumCorrection
from horovod_sparse.ops import cpu
from horovod_sparse.ops.cpu import sparsify as fused
from horovod_sparse.ops.pieces import float32_views
from horovod_sparse.ops.views import as_like, numpy_view

#: the candidate buffers hold this many entries per k, and at least 1/CANDIDATE_SHARE of the buffer
CANDIDATES_PER_K = 4
CANDIDATE_SHARE = 32
#: a pass that found more candidates than that grows them to its count and a quarter more, up to
#: 1/CANDIDATE_CEILING of the buffer (the estimated-threshold rules collect below a threshold that
#: may select 2k, and a heavy tail puts 3-11x the selection above their floor: without room, each of
#: their steps paid one more read pass of the buffer); a rule that asks for all of them (a fixed
#: threshold) gets its count and a quarter more, whatever the ceiling
CANDIDATE_HEADROOM = 1.25
CANDIDATE_CEILING = 16


@dataclass
class Candidates:
    """Every entry of acc whose magnitude key is at least ``floor``, in index order.

    indices : sorted int64 indices (acc's library); keys : their int32 keys;
    count : how many entries reach the floor, written or not;
    complete : whether all ``count`` of them are in ``indices`` (the buffer may hold fewer).
    """

    floor: int
    indices: Any
    keys: Any
    count: int

    @property
    def complete(self):
        return int(self.indices.shape[0]) == self.count


class CandidateScratch:
    """The candidate buffers of one buffer of ``n`` entries with target ``k``, reused between
    steps (numpy: what the kernel writes into; a torch tensor sees them without a copy)."""

    def __init__(self, n, k):
        self.room(min(n, max(CANDIDATES_PER_K * k, n // CANDIDATE_SHARE) + 64))
        self.ceiling = min(n, n // CANDIDATE_CEILING + 64)

    def fit(self, found, wanted=False):
        """After a pass that found ``found`` candidates: if they did not fit, grow the buffers so
        that as many, and a quarter more, fit next time; up to the ceiling, unless the rule
        ``wanted`` all of them."""
        grown = int(found * CANDIDATE_HEADROOM)
        if wanted:
            self.room(grown)
        elif found > self.index.shape[0]:
            self.room(min(self.ceiling, grown))

    def room(self, capacity):
        """Make the buffers hold at least ``capacity`` candidates (they only grow: a rule whose
        selections are larger than the estimate keeps the larger buffers)."""
        if getattr(self, "index", None) is None or self.index.shape[0] < capacity:
            self.index = np.empty(capacity, np.int64)
            self.key = np.empty(capacity, np.int32)


def fusable(memory, pieces):
    """Whether the fused pass can serve: kernels on, a memory it knows, float32 pieces on the CPU."""
    if not cpu.enabled() or not pieces:
        return False
    if not (isinstance(memory, MomentumCorrection) or (isinstance(memory, ErrorFeedback) and memory.enabled)):
        return False
    return float32_views(pieces) is not None


def rescan(acc, floor, scratch, room=0):
    """The :class:`Candidates` of an acc already written at another ``floor``: one read pass
    (:func:`~horovod_sparse.ops.cpu.sparsify.scan`), where a rule asks below the first pass's
    floor, or where that floor left more candidates than the buffers hold (``room``: the rule
    wants all that many; the buffers are grown to hold them first)."""
    scratch.fit(room, wanted=True)
    count, _ = fused.scan(numpy_view(acc), np.int32(floor), scratch.index, scratch.key, 0, 0)
    return _written(scratch, int(floor), count, acc)


def _written(scratch, floor, count, like):
    """The :class:`Candidates` a pass left in ``scratch`` (``count`` found, as many written as fit)."""
    written = min(count, scratch.index.shape[0])
    return Candidates(floor, as_like(scratch.index[:written], like), as_like(scratch.key[:written], like), count)


def first_pass(memory, pieces, floor, scratch):
    """``(acc, finite, candidates)`` of this step's gradient ``pieces`` (1-D float arrays, the
    buffer back to back), for which :func:`fusable` holds (the caller takes the memory's own
    passes where it does not).

    memory : the sparsifier's :class:`~horovod_sparse.memory.Memory`; its state is only read.
    floor : the rule's candidate floor (an int key), or None (no candidates wanted).
    scratch : a :class:`CandidateScratch`.
    """
    like = pieces[0]
    floor = fused.NO_FLOOR if floor is None else int(floor)
    floor32 = np.int32(floor)
    count = nonfinite = offset = 0
    if isinstance(memory, MomentumCorrection):
        velocity, velocity_out = (numpy_view(a) for a in memory.buffers("velocity", like))
        residual, acc = memory.buffers("residual", like)
        residual_v, acc_v = numpy_view(residual), numpy_view(acc)
        momentum = np.float32(memory.momentum)
        for piece in pieces:
            part = slice(offset, offset + int(piece.shape[0]))
            count, bad = fused.momentum_scan(
                numpy_view(piece), velocity[part], residual_v[part], momentum, velocity_out[part], acc_v[part],
                floor32, scratch.index, scratch.key, count, offset)
            nonfinite, offset = nonfinite + bad, part.stop
    else:
        residual, acc = memory.buffers("residual", like)
        residual_v, acc_v = numpy_view(residual), numpy_view(acc)
        for piece in pieces:
            part = slice(offset, offset + int(piece.shape[0]))
            count, bad = fused.accumulate_scan(
                numpy_view(piece), residual_v[part], acc_v[part], floor32, scratch.index, scratch.key, count, offset)
            nonfinite, offset = nonfinite + bad, part.stop
    candidates = _written(scratch, floor, count, acc)
    scratch.fit(count)  # (new buffers: the candidates keep viewing the old ones)
    return acc, nonfinite == 0, candidates
