"""The stateful per-buffer pipeline: error feedback -> select -> sparse allreduce -> residual update.

One :class:`Sparsifier` holds everything one gradient buffer of length ``n`` needs on
this rank from step to step: its memory (residual, or DGC's velocities), its
selection rule's state (thresholds), its exchange engine (a
:class:`~horovod_sparse.exchange.SparseAllreduce` it owns, on a duplicated
communicator) and a step counter. Every rank must call :meth:`Sparsifier.step` the
same number of times in the same order (the engine checks it and raises
:class:`~horovod_sparse.exchange.ExchangeError` on every rank otherwise).
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from horovod_sparse.exchange import ALGORITHMS, SparseAllreduce, Traffic, intersect_sorted
from horovod_sparse.sparsify.memory import ErrorFeedback, MomentumCorrection
from horovod_sparse.sparsify.selection import VALUE_DTYPE, keys_of
from horovod_sparse.closing import ClosesOnExit

#: exchanges whose global selection may drop locally selected entries: the residual
#: is cleared only at local ∩ global selected (Ok-Topk's rule), not at all local ones
SELECTING_EXCHANGES = ("oktopk", "gtopk")
_STATE_FORMAT = 1


@dataclass(frozen=True)
class StepInfo:
    """What one :meth:`Sparsifier.step` did on this rank.

    step : the step's number (0-based).
    local_indices : sorted int64 indices this rank selected and sent.
    sent_values : float32 values sent, aligned with ``local_indices``.
    selected : sorted int64 global selection; equals the result's support for the
        allgather/dsa exchanges, the global top-k for oktopk/gtopk, all of [0, n)
        on dense (warm-up) steps.
    cleared_indices : sorted int64 indices whose accumulated values were consumed
        (the residual was zeroed there): ``local_indices`` for allgather/dsa/dense,
        ``local_indices ∩ selected`` for oktopk/gtopk.
    kept_values : float32 accumulated values at ``cleared_indices`` (this rank's
        share of the result). Conservation: these + new residual == accumulated.
    method : how the local selection was found ("exact", "threshold", "estimate",
        "corrected", or "dense" on warm-up steps).
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    """

    step: int
    local_indices: np.ndarray
    sent_values: np.ndarray
    selected: np.ndarray
    cleared_indices: np.ndarray
    kept_values: np.ndarray
    method: str
    traffic: Traffic


class Sparsifier(ClosesOnExit):
    """State of one compressed gradient buffer of length ``n`` on this rank.

    Parameters
    ----------
    n : int >= 0
        Buffer length (elements).
    comm : mpi4py communicator
        The ranks that exchange this buffer; duplicated by the engine (collective).
    rule : a selection rule of :mod:`horovod_sparse.sparsify.rules`.
    k : int >= 0
        Target count of the selection (and of the global selection of the
        oktopk/gtopk exchanges); ``selection.k_for(density, n)``.
    exchange : one of "allgather", "dsa", "oktopk", "gtopk" (see
        :class:`~horovod_sparse.exchange.SparseAllreduce`).
    error_feedback : keep what was not consumed in the residual (default True).
    momentum : None, or DGC's momentum factor in [0, 1): then the memory is
        :class:`~horovod_sparse.sparsify.memory.MomentumCorrection` instead of
        error feedback.
    warmup_steps : number of first steps that send the whole accumulated buffer
        through a dense allreduce and clear the residual (Ok-Topk's warm-up).
    exchange_params : extra keyword parameters of the engine (e.g. oktopk's tau).

    Attributes: ``n``, ``k``, ``step_count``, ``residual`` (float32, length n; for
    DGC the accumulated velocity v), ``velocity`` (DGC's u, else None), ``last``
    (:class:`StepInfo` of the latest step, None before the first), ``traffic``
    (cumulative :class:`~horovod_sparse.exchange.Traffic`).
    """

    def __init__(self, n, comm, rule, k, exchange="allgather", error_feedback=True, momentum=None,
                 warmup_steps=0, exchange_params=None):
        if exchange not in ALGORITHMS or exchange == "dense":
            raise ValueError(f"exchange must be one of {[a for a in ALGORITHMS if a != 'dense']}, "
                             f"got {exchange!r}")
        self.n, self.k, self.rule, self.exchange = int(n), int(k), rule, exchange
        self.warmup_steps = int(warmup_steps)
        self.memory = (ErrorFeedback(self.n, error_feedback) if momentum is None
                       else MomentumCorrection(self.n, momentum))
        engine_k = max(1, self.k) if exchange in SELECTING_EXCHANGES else None
        self.engine = SparseAllreduce(self.n, exchange, k=engine_k, comm=comm, average=False,
                                      **(exchange_params or {}))
        # Created up front (it is a collective) only when there is a warm-up.
        self.dense_engine = (SparseAllreduce(self.n, "dense", comm=comm, average=False)
                             if self.warmup_steps > 0 else None)
        self.rank = self.engine.rank
        self.step_count = 0
        self.last: Optional[StepInfo] = None

    # ------------------------------------------------------------------ state
    @property
    def residual(self):
        return self.memory.residual

    @property
    def velocity(self):
        return getattr(self.memory, "velocity", None)

    @property
    def traffic(self):
        """Cumulative Traffic of this buffer's exchanges on this rank."""
        total = self.engine.traffic
        return total + self.dense_engine.traffic if self.dense_engine is not None else total

    # ------------------------------------------------------------------- step
    def step(self, grad, tag=0):
        """Exchange this step's gradient; return the sum over ranks of what they sent.

        grad : 1-D float array of length n (cast to float32), this rank's gradient.
            A wrong length raises ValueError on this rank alone (a programming error:
            the frontends flatten the same layout on every rank).
        tag : int passed to :meth:`SparseAllreduce.allreduce`; ranks passing
            different tags all get an ExchangeError (use a CRC of the layout).

        Returns a new float32 array of length n, bitwise identical on every rank:
        the sum of the sent values on the global selection, zero elsewhere. If the
        exchange raises, the sparsifier's state is left as it was before the call.
        """
        grad = np.asarray(grad)
        if grad.ndim != 1 or grad.size != self.n or grad.dtype.kind != "f":
            raise ValueError(f"grad must be a 1-D float array of length n={self.n}, "
                             f"got shape {grad.shape} dtype {grad.dtype}")
        grad = grad.astype(VALUE_DTYPE, copy=False)
        acc = self.memory.accumulate(grad)
        rule_state = self.rule.state_dict()
        try:
            if self.step_count < self.warmup_steps:
                local, method, engine = np.arange(self.n, dtype=np.int64), "dense", self.dense_engine
            else:
                local, method = self.rule.select(acc, keys_of(acc), self.k, self.step_count, self.rank)
                engine = self.engine
            sent = acc[local]
            result = engine.allreduce(local, sent, tag=tag)
        except BaseException:
            self.rule.load_state_dict(rule_state)  # nudged thresholds are not kept either
            raise
        selected = np.asarray(result.selected, dtype=np.int64) if engine is self.engine else local
        if engine is self.engine and self.exchange in SELECTING_EXCHANGES:
            cleared = intersect_sorted(local, selected)
        else:
            cleared = local
        kept = sent if cleared is local else acc[cleared]
        self.memory.commit(acc, cleared)
        out = result.dense()
        self.last = StepInfo(self.step_count, local, sent, selected, cleared, kept, method,
                             result.traffic)
        self.step_count += 1
        return out

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        """numpy arrays and ints only: memory, rule state, step counter, engine state."""
        d = {"format": _STATE_FORMAT, "n": self.n, "step": self.step_count}
        d.update({"memory_" + key: v for key, v in self.memory.state_dict().items()})
        d.update({"rule_" + key: v for key, v in self.rule.state_dict().items()})
        d.update(_engine_state("engine_", self.engine))
        if self.dense_engine is not None:
            d.update(_engine_state("dense_engine_", self.dense_engine))
        return d

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n and world size; on every rank, each its own)."""
        if int(d.get("format", -1)) != _STATE_FORMAT or int(d.get("n", -1)) != self.n:
            raise ValueError(f"state_dict is for format {d.get('format')!r} and n={d.get('n')!r}; "
                             f"this sparsifier has format {_STATE_FORMAT} and n={self.n}")
        self.memory.load_state_dict(_sub(d, "memory_"))
        self.rule.load_state_dict(_sub(d, "rule_"))
        _load_engine_state(self.engine, _sub(d, "engine_"))
        if self.dense_engine is not None:
            _load_engine_state(self.dense_engine, _sub(d, "dense_engine_"))
        self.step_count = int(d["step"])
        self.last = None

    def close(self):
        """Free the engines' communicators (idempotent)."""
        self.engine.close()
        if self.dense_engine is not None:
            self.dense_engine.close()

    def __repr__(self):
        return (f"Sparsifier(n={self.n}, k={self.k}, rule={self.rule.name}, "
                f"exchange={self.exchange!r}, step={self.step_count})")


def _sub(d, prefix):
    return {key[len(prefix):]: v for key, v in d.items() if key.startswith(prefix)}


def _engine_state(prefix, engine):
    """The engine's state_dict with its algorithm name as an int (numpy/ints only)."""
    state = dict(engine.state_dict())
    state["algorithm"] = ALGORITHMS.index(state["algorithm"])
    return {prefix + key: v for key, v in state.items()}


def _load_engine_state(engine, state):
    state = dict(state)
    code = int(state.get("algorithm", -1))
    state["algorithm"] = ALGORITHMS[code] if 0 <= code < len(ALGORITHMS) else code
    state = {key: (int(v) if key in ("format", "n", "world_size", "calls") else v)
             for key, v in state.items()}
    engine.load_state_dict(state)
