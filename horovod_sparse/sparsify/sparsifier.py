"""The stateful per-buffer pipeline: memory -> select -> sparse allreduce -> residual update.

One :class:`Sparsifier` holds everything one gradient buffer of length ``n`` needs on
this rank from step to step: its memory (error feedback, or DGC's momentum
correction, :mod:`horovod_sparse.memory`), its selection rule's carried threshold
(:mod:`.selection`), its exchange engine (a :class:`~horovod_sparse.exchange.SparseAllreduce`
it owns, on a duplicated communicator), scratch buffers and a step counter. Every rank
must call :meth:`Sparsifier.step_sparse` (or :meth:`Sparsifier.step`) the same number
of times in the same order (the engine checks it and raises
:class:`~horovod_sparse.exchange.ExchangeError` on every rank otherwise).

The buffer is numpy or a torch tensor on any device; the step runs in its library and
device (:mod:`horovod_sparse.ops`), and only the selected (index, value) pairs
cross to the host for the exchange, and the summed pairs come back.
"""
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from horovod_sparse.exchange import ALGORITHMS, SparseAllreduce, Traffic
from horovod_sparse.memory import ErrorFeedback, MomentumCorrection
from horovod_sparse.ops import host, kernels, namespace
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.ops.indices import compact, isin_sorted, take
from horovod_sparse.ops.pieces import as_piece, is_pieces
from horovod_sparse.ops.views import numpy_view
from horovod_sparse.pipeline import Pipeline, engine_state, load_engine_state, with_prefix, without_prefix
from horovod_sparse.sparsify.first_pass import CandidateScratch, first_pass, fusable, rescan
from horovod_sparse.sparsify.selection import MagnitudeKeys, k_for
from horovod_sparse.warmup import Warmup

#: exchanges whose global selection may drop locally selected entries: the residual
#: is cleared only at local ∩ global selected (Ok-Topk's rule), not at all local ones
SELECTING_EXCHANGES = ("oktopk", "gtopk")


@dataclass(frozen=True)
class StepInfo:
    """What one step did on this rank (arrays in the buffer's library and device).

    step : the step's number (0-based).
    local_indices : sorted int64 indices this rank selected and sent.
    sent_values : float32 values sent, aligned with ``local_indices``.
    selected : sorted int64 global selection; equals the result's support for the
        allgather/dsa exchanges, the global top-k for oktopk/gtopk, all of [0, n)
        on dense (warm-up) steps.
    method : how the local selection was found ("exact", "threshold", "estimate",
        "corrected", or "dense" on warm-up steps).
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    consumed : which of ``local_indices`` were consumed: None (all of them: allgather,
        dsa, dense), their positions (int64), or on a device a bool mask over them (its
        compaction reads the count back, so it waits until asked for).
    cleared_indices : sorted int64 indices whose accumulated values were consumed
        (the residual was zeroed there): ``local_indices`` for allgather/dsa/dense,
        ``local_indices ∩ selected`` for oktopk/gtopk.
    kept_values : float32 accumulated values at ``cleared_indices`` (this rank's
        share of the result). Conservation: these + new residual == accumulated.
    """

    step: int
    local_indices: Any
    sent_values: Any
    selected: Any
    method: str
    traffic: Traffic
    consumed: Any = None

    @property
    def cleared_indices(self):
        return self._consumed_of(self.local_indices)

    @property
    def kept_values(self):
        return self._consumed_of(self.sent_values)

    def _consumed_of(self, x):
        if self.consumed is None:
            return x
        bools = namespace.dtype_of(self.consumed, "bool") == self.consumed.dtype
        return take(x, compact(self.consumed) if bools else self.consumed)


class Sparsifier(Pipeline):
    """State of one compressed gradient buffer of length ``n`` on this rank: the
    :class:`~horovod_sparse.pipeline.Pipeline` that sends a selection of entries.

    Parameters
    ----------
    n : int >= 0
        Buffer length (elements).
    comm : mpi4py communicator
        The ranks that exchange this buffer; duplicated by the engine (collective).
    rule : a selection rule of :mod:`horovod_sparse.sparsify.selection`.
    k : int >= 0
        Target count of the selection (and of the global selection of the
        oktopk/gtopk exchanges); ``selection.k_for(density, n)``.
    exchange : one of "allgather", "dsa", "oktopk", "gtopk" (see
        :class:`~horovod_sparse.exchange.SparseAllreduce`).
    error_feedback : keep what was not consumed in the residual (default True).
    momentum : None, or DGC's momentum factor in [0, 1): then the memory is
        :class:`~horovod_sparse.memory.MomentumCorrection` instead of error feedback.
    warmup_steps : number of first steps that send the whole accumulated buffer
        through a dense allreduce and clear the residual (Ok-Topk's warm-up).
    ramp : after those, as many steps whose density falls geometrically from 1 to k / n
        (:class:`~horovod_sparse.warmup.Warmup`, DGC's warm-up); only with the exchanges
        whose count may vary ("allgather", "dsa"). A ramp step whose count reaches n / P
        goes through the dense allreduce, which then sends fewer bytes.
    exchange_params : extra keyword parameters of the engine (e.g. oktopk's tau).

    Attributes: ``n``, ``k``, ``step_count``, ``residual`` (float32, length n; for
    DGC the accumulated velocity v; the live buffer: copy it to keep it), ``velocity``
    (DGC's u, else None), ``last`` (:class:`StepInfo` of the latest step, None before
    the first), ``traffic`` (cumulative :class:`~horovod_sparse.exchange.Traffic`).
    """

    def __init__(self, n, comm, rule, k, exchange="allgather", error_feedback=True, momentum=None,
                 warmup_steps=0, ramp=False, exchange_params=None):
        if exchange not in ALGORITHMS or exchange == "dense":
            raise ValueError(f"exchange must be one of {[a for a in ALGORITHMS if a != 'dense']}, "
                             f"got {exchange!r}")
        if ramp and exchange in SELECTING_EXCHANGES:
            raise ValueError(f"ramp: the {exchange!r} exchange selects a fixed count; use 'allgather' or 'dsa'")
        self.n, self.k, self.rule, self.exchange = int(n), int(k), rule, exchange
        self.warmup_steps = int(warmup_steps)
        self.warmup = Warmup(self.warmup_steps, ramp=ramp)
        self.memory = (ErrorFeedback(self.n, error_feedback) if momentum is None
                       else MomentumCorrection(self.n, momentum))
        engine_k = max(1, self.k) if exchange in SELECTING_EXCHANGES else None
        self.engine = SparseAllreduce(self.n, exchange, k=engine_k, comm=comm, average=False,
                                      **(exchange_params or {}))
        # Created up front (it is a collective) only when there is a warm-up.
        self.dense_engine = (SparseAllreduce(self.n, "dense", comm=comm, average=False)
                             if self.warmup_steps > 0 else None)
        self._exchanges = (self.engine,) + ((self.dense_engine,) if self.dense_engine is not None else ())
        self.rank = self.engine.rank
        self.last: Optional[StepInfo] = None
        self._candidate_scratch = None  # the first pass's candidate buffers (made at the first fused step)

    # ------------------------------------------------------------------ state
    @property
    def residual(self):
        return self.memory.residual

    @property
    def velocity(self):
        return getattr(self.memory, "velocity", None)

    def k_at(self, step):
        """The count selected at ``step``: ``n`` while the warm-up is dense (or its ramp's count
        reaches n / P), the ramp's count, then ``k``."""
        phase = self.warmup.phase(step)
        if phase == "dense":
            return self.n
        if phase == "steady" or self.n == 0:
            return self.k
        k = max(self.k, k_for(self.warmup.density(step, self.k / self.n), self.n))
        return self.n if k * self.engine.size >= self.n else k

    def regime(self):
        """The warm-up's phase at the next step, in words (for reports)."""
        return self.warmup.describe(self.step_count, self.k / self.n if self.n else 0.0)

    # ------------------------------------------------------------------- step
    def step_sparse(self, grad, tag=0, finite=True):
        """Exchange this step's gradient; return the sum over ranks of what they sent, sparse.

        grad : 1-D float buffer of length n (numpy, or a torch tensor on any device; cast
            to float32), this rank's gradient; or a list of 1-D float pieces that are that
            buffer back to back (a step's gradients, flattened: the memory reads them where
            they are instead of a fused copy). Never modified. A wrong length raises
            ValueError on this rank alone (a programming error: the frontends flatten
            the same layout on every rank).
        tag : int passed to :meth:`SparseAllreduce.allreduce`; ranks passing different
            tags all get an ExchangeError (use a CRC of the layout).
        finite : False when another gradient of this rank's step overflowed: the step is
            skipped on every rank, as for an overflow here.

        Returns ``(indices, values)``: sorted unique int64 indices and their float32 sums,
        in grad's library and device, bitwise identical on every rank. If the exchange
        raises, the sparsifier's state is left as it was before the call; so it is when
        any rank's acc holds an inf or a NaN (NonFiniteGradientError on every rank).

        1. acc = memory.accumulate(grad): grad + residual (DGC: momentum correction)
           into a spare buffer, whether it is finite, and the entries reaching the rule's
           candidate floor: one fused pass on the CPU (:mod:`.first_pass`), else the
           memory's pass, one reduction, and no candidates;
        2. local selection by the rule on acc's magnitude keys (from the candidates, in
           O(k); else one pass for the keys, usually one comparison and one compaction);
        3. gather the selected values; only (indices, values) cross to the host, packed
           into one transfer;
        4. the exchange (numpy + mpi4py), and the summed pairs back to the device in one
           transfer;
        5. cleared = local (allgather/dsa) or local ∩ global selection (oktopk/gtopk);
        6. commit: the residual is acc with zeros at the cleared indices.
        """
        acc, acc_finite, candidates = self._first_pass(grad)                  # step 1
        finite = finite and acc_finite
        rule_state = self.rule.snapshot()
        try:
            k = self.k_at(self.step_count)
            warmup = k == self.n and self.k < self.n  # the same engine on every rank, finite or not
            if not finite:  # nothing worth selecting: the header tells every rank to skip
                local, method = namespace.arange(0, acc), "skipped"
                engine = self.dense_engine if warmup else self.engine
            elif warmup:
                local, method, engine = namespace.arange(self.n, acc), "dense", self.dense_engine
            else:
                local, method = self.rule.select(acc, self._keys(acc, candidates), k,  # step 2
                                                 self.step_count, self.rank)
                engine = self.engine
            sent = take(acc, local)                                     # step 3
            result = engine.allreduce(*host.to_host_packed(local, sent), tag=tag, finite=finite)
        except BaseException:
            self.rule.restore(rule_state)  # carried thresholds are not kept either
            raise
        consumed, where = None, None
        if engine is self.dense_engine:                                         # step 4
            indices, values = local, host.from_host(result.values, acc)
            selected = local
        else:
            if result.selected is result.indices:
                indices, values = host.from_host_packed((result.indices, result.values), acc)
                selected = indices
            else:
                indices, values, selected = host.from_host_packed(
                    (result.indices, result.values, result.selected), acc)
            if self.exchange in SELECTING_EXCHANGES:                            # step 5
                kept = isin_sorted(local, selected)
                if namespace.is_torch(kept) and numpy_view(kept) is None:  # a device's mask, not compacted
                    consumed = where = kept
                else:
                    consumed = compact(kept)
        cleared = local if consumed is None or where is not None else take(local, consumed)
        self.memory.commit_cleared(acc, cleared, where)                         # step 6
        self.last = StepInfo(self.step_count, local, sent, selected, method, result.traffic, consumed)
        self.step_count += 1
        return indices, values

    def step(self, grad, tag=0, finite=True):
        """:meth:`step_sparse`, densified: a new float32 buffer of length n in grad's library
        and device, the sum of the sent values on the global selection, zero elsewhere."""
        indices, values = self.step_sparse(grad, tag=tag, finite=finite)
        if indices.shape[0] == self.n:  # every index (a dense warm-up step): values is dense
            return values
        out = namespace.zeros(self.n, "float32", values)
        kernels.put(out, indices, values)
        return out

    def _first_pass(self, grad):
        """Step 1: ``(acc, finite, candidates)`` (:func:`~horovod_sparse.sparsify.first_pass.first_pass`)."""
        pieces = [_as_1d_float(piece, self.n) for piece in (grad if is_pieces(grad) else [grad])]
        if sum(int(piece.shape[0]) for piece in pieces) != self.n or not fusable(self.memory, pieces):
            acc = self._accumulate(grad)  # (raises the ValueError of a wrong length)
            return acc, all_finite(acc), None
        if self._candidate_scratch is None:
            self._candidate_scratch = CandidateScratch(self.n, self.k)
        return first_pass(self.memory, pieces, self.rule.candidate_floor(), self._candidate_scratch)

    def _accumulate(self, grad):
        """Step 1 on a buffer or on its pieces; ValueError (state untouched) unless grad is
        1-D float data of n elements in all."""
        pieces = [_as_1d_float(piece, self.n) for piece in (grad if is_pieces(grad) else [grad])]
        total = sum(int(piece.shape[0]) for piece in pieces)
        if total != self.n:
            got = (f"pieces of {total} elements in all" if is_pieces(grad)
                   else f"shape {tuple(pieces[0].shape)} dtype {pieces[0].dtype}")
            raise ValueError(f"grad must be a 1-D float array of length n={self.n}, got {got}")
        if not is_pieces(grad) or not pieces:
            flat = pieces[0] if pieces else np.empty(0, np.float32)
            if namespace.is_tensorflow(flat):
                return self.memory.accumulate(flat)
            if namespace.is_torch(flat):
                return self.memory.accumulate(flat.to(namespace.dtype_of(flat, "float32")))
            return self.memory.accumulate(flat.astype(np.float32, copy=False))
        return self.memory.accumulate_pieces(pieces)

    def _keys(self, acc, candidates=None):
        """acc's magnitude keys, in the workspace's buffers (computed only where the candidates
        do not answer)."""
        rescan_at = None if candidates is None else (
            lambda key, room=0: rescan(acc, key, self._candidate_scratch, room))
        return MagnitudeKeys(acc, *self._workspace_for(acc), candidates=candidates, rescan=rescan_at)

    def _new_workspace(self, like):
        """Scratch for the magnitude keys: (keys int32, mask bool); none on TensorFlow, whose
        kernels make new tensors."""
        if namespace.is_tensorflow(like):
            return None, None
        return namespace.empty(self.n, "int32", like), namespace.empty(self.n, "bool", like)

    # ------------------------------------------------------------ checkpoints
    def _own_state(self):
        """Memory, rule state (carried thresholds) and engine states, prefixed."""
        d = with_prefix("memory_", self.memory.state_dict())
        d.update(with_prefix("rule_", self.rule.state_dict()))
        d.update(engine_state("engine_", self.engine))
        if self.dense_engine is not None:
            d.update(engine_state("dense_engine_", self.dense_engine))
        return d

    def _load_own_state(self, state):
        self.memory.load_state_dict(without_prefix(state, "memory_"))
        self.rule.load_state_dict(without_prefix(state, "rule_"))
        load_engine_state(self.engine, state, "engine_")
        if self.dense_engine is not None:
            load_engine_state(self.dense_engine, state, "dense_engine_")

    def __repr__(self):
        return (f"Sparsifier(n={self.n}, k={self.k}, rule={self.rule.name}, "
                f"exchange={self.exchange!r}, step={self.step_count})")


def _as_1d_float(array, n):
    """A contiguous, detached 1-D float array (numpy, torch or TensorFlow), or ValueError."""
    piece = as_piece(array)
    if piece is None:
        array = array if hasattr(array, "dtype") else np.asarray(array)
        raise ValueError(f"grad must be a 1-D float array of length n={n}, "
                         f"got shape {tuple(array.shape)} dtype {array.dtype}")
    return piece
