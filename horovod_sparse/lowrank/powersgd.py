"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS'19), as PyTorch's DDP ``powerSGD_hook``.

One :class:`PowerSGDPipeline` holds what one fused gradient buffer of length ``n`` needs on
this rank from step to step: the error-feedback residual, the warm-start Q of every
compressed matrix, a step counter and a :class:`~horovod_sparse.exchange.comm.CountingComm`
(a duplicated communicator that counts every byte). It has the interface of
:class:`~horovod_sparse.sparsify.Sparsifier`, so the frontends drive it the same way.

One step, per compressed matrix M (a x b, see :mod:`.plan`), with rank r:

1. M = gradient + residual (error feedback);
2. Q <- orthonormalised Q (the summed Q of the previous step with warm start, else a
   fresh standard-normal draw; the first Q is a draw too). Draws come from
   ``np.random.default_rng([seed, matrix index, step])`` and so are identical on every
   rank. Orthonormalising Q first, as PyTorch does, keeps P at the scale of M instead
   of M M^T (it changes nothing else: the span of P is the same);
3. P = M Q; ONE Allreduce (sum) of all P matrices and the dense vector, float32;
4. P_orth = Gram-Schmidt(sum of P) (:mod:`.orthogonal`; identical on every rank);
5. Q_local = M^T P_orth; a second Allreduce (sum) of all Q matrices, float32;
6. result = P_orth (sum of Q)^T; this rank's share ``kept`` = P_orth Q_local^T (so the
   result is the sum over ranks of ``kept``, up to float32 rounding of the Q sum);
   residual = M - kept; the summed Q is the next step's warm start.

The dense part (1-D gradients, matrices too small or too thin to gain) is summed exactly
by the first Allreduce; its ``kept`` is the accumulated value and its residual zero.

Bytes (payload, counted by CountingComm's ring model, sent = received), per step:
``8 * (N1 - c(N1)) + 8 * (N2 - c(N2))`` with ``N1 = sum_m r_m a_m + dense_n`` (P's and the
dense vector), ``N2 = sum_m r_m b_m`` (Q's) and ``c(N) = floor((i+1)N/P) - floor(iN/P)``
this rank i's ring chunk, i.e. ``2(P-1)/P * 4 * (sum_m r_m (a_m + b_m) + dense_n)`` when P
divides N1 and N2. An empty Allreduce is skipped (no bytes, no message). On top of that,
control bytes: one Allgather of a 10-int64 agreement header, 80 (P-1) bytes each way.
"""
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

from horovod_sparse.exchange.comm import CountingComm
from horovod_sparse.exchange.errors import ExchangeError
from horovod_sparse.exchange.traffic import Traffic
from horovod_sparse.exchange.validation import TAG_ERROR_CODE, agree, tag_as_int64
from horovod_sparse.checks import check_bool, check_int
from horovod_sparse.closing import ClosesOnExit

from .orthogonal import orthonormalize
from .plan import make_plan

_STATE_FORMAT = 1
#: error code of this rank's header when its gradient is not a 1-D float array of length n
#: (printed by the agreement as "invalid input"; ``error_detail`` holds the length seen)
BAD_GRADIENT_CODE = 20
_ALGORITHM_NAMES = ("powersgd",)
_HINT = (" [PowerSGD: 'invalid input' = that rank's grad is not a 1-D float array of length n; "
         "'params' = the ranks' layouts (or rank, error_feedback, warm_start, seed, "
         "min_compression_rate) differ]")


@dataclass(frozen=True)
class PowerSGDStepInfo:
    """What one :meth:`PowerSGDPipeline.step` did on this rank.

    step : the step's number (0-based).
    kept : float32 length n, this rank's contribution: P_orth Q_local^T on compressed
        matrices, the accumulated gradient on the dense part. With error feedback,
        kept + new residual == gradient + old residual (up to one float32 rounding).
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    compressed_matrices : number of matrices exchanged as P and Q.
    """

    step: int
    kept: np.ndarray
    traffic: Traffic
    compressed_matrices: int


class PowerSGDPipeline(ClosesOnExit):
    """State of one PowerSGD-compressed gradient buffer of length ``n`` on this rank.

    Parameters
    ----------
    n : int >= 0
        Buffer length (elements).
    comm : mpi4py communicator
        The ranks that exchange this buffer; duplicated here (a collective call).
    rank : int >= 1
        Rank r of the approximation (columns of P and Q); a matrix uses min(r, a, b).
    layout : :class:`~horovod_sparse.layout.GradientLayout` or None
        Where each gradient lies in the buffer (``layout.n`` must equal n). Each entry
        with ndim >= 2 is a matrix candidate (see :mod:`.plan`). None: the buffer is one
        zero-padded near-square matrix, a = ceil(sqrt(n)), b = ceil(n / a).
    error_feedback : bool (default True)
        Compress gradient + residual and keep residual = that - kept.
    warm_start : bool (default True)
        Reuse the previous step's summed Q (one power iteration per step, continued
        across steps); False draws a fresh Q every step.
    seed : int in [0, 2**63) (default 0)
        Seed of the Q draws; must be the same on every rank.
    min_compression_rate : float > 0 (default 2.0)
        A matrix is compressed when a*b >= min_compression_rate * r*(a+b).

    Attributes: ``n``, ``plan`` (:class:`~.plan.Plan`), ``approx_rank``, ``step_count``,
    ``residual`` (float32 length n, or None without error feedback), ``last``
    (:class:`PowerSGDStepInfo`, None before the first step), ``traffic`` (cumulative),
    ``world_rank``, ``world_size``.

    Guarantee (tested): span(P) = span((sum_i M_i) Q), so when the sum over ranks of the
    accumulated matrices has rank <= r the result is that sum, in exact arithmetic. In
    float32 the error grows with the conditioning of V^T Q (V: the sum's row space):
    the first step (a random Q) reconstructs any rank-r sum to float32 accuracy, and
    with warm start so does every later step while the row space stays put (the summed
    Q then spans it). Fresh spaces every step with a warm Q are not covered.
    """

    def __init__(self, n, comm, rank, layout=None, error_feedback=True, warm_start=True, seed=0,
                 min_compression_rate=2.0):
        self.n = check_int("n", n, 0)
        self.approx_rank = check_int("rank", rank, 1, 2 ** 31 - 1)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.warm_start = check_bool("warm_start", warm_start)
        self.seed = check_int("seed", seed, 0)
        rate = min_compression_rate
        if isinstance(rate, (bool, np.bool_)) or not isinstance(rate, (int, float, np.integer, np.floating)) \
                or not np.isfinite(rate) or not rate > 0:
            raise ValueError(f"min_compression_rate must be a finite number > 0, got {rate!r}")
        self.min_compression_rate = float(rate)
        if layout is not None and getattr(layout, "n", None) != self.n:
            raise ValueError(f"layout must be None or a GradientLayout of n={self.n} elements, "
                             f"got one of {getattr(layout, 'n', None)!r}")
        self.layout = layout
        self.plan = make_plan(self.n, self.approx_rank, self.min_compression_rate, layout)
        # Everything the ranks must share beyond n and rank, as one int in the header.
        identity = (self.plan.signature(), None if layout is None else layout.tag, self.error_feedback,
                    self.warm_start, self.seed, self.min_compression_rate)
        self._params_code = zlib.crc32(repr(identity).encode())

        self._comm = CountingComm(comm)  # collective: after every local check
        self.world_rank, self.world_size = self._comm.rank, self._comm.size
        self._residual = np.zeros(self.n, np.float32) if self.error_feedback else None
        self._q = [self._draw(i, 0) for i in range(len(self.plan.matrices))]
        self.step_count = 0
        self._calls = 0
        self.last: Optional[PowerSGDStepInfo] = None

    # ------------------------------------------------------------------ state
    @property
    def residual(self):
        return self._residual

    @property
    def traffic(self):
        """Cumulative Traffic of this buffer's exchanges on this rank."""
        return self._comm.traffic

    @property
    def q_matrices(self):
        """The Q of every compressed matrix the next step starts from (float32, cols x r)."""
        return list(self._q)

    def _draw(self, index, step):
        block = self.plan.matrices[index]
        rng = np.random.default_rng([self.seed, index, step])
        return rng.standard_normal((block.cols, block.rank)).astype(np.float32)

    def _start_q(self, index, step):
        """The orthonormal float64 Q this step multiplies M by (identical on every rank)."""
        q = self._q[index] if self.warm_start else self._draw(index, step)
        basis, zero_columns = orthonormalize(q)
        if zero_columns:
            # A zero summed Q (e.g. a zero gradient) would stay zero forever: draw anew.
            basis, _ = orthonormalize(self._draw(index, step))
        return basis

    def _matrix(self, acc, block):
        """The (rows, cols) float32 view of a block of the accumulated buffer (a padded copy
        when the whole buffer is one matrix and n is not rows * cols)."""
        if block.rows * block.cols == block.size:
            return acc[block.offset:block.offset + block.size].reshape(block.rows, block.cols)
        padded = np.zeros(block.rows * block.cols, np.float32)
        padded[:block.size] = acc[block.offset:block.offset + block.size]
        return padded.reshape(block.rows, block.cols)

    # ------------------------------------------------------------------- step
    def _local_error(self, grad):
        """(error code, detail, grad as float32 or None): checked here, reported by agree()."""
        try:
            g = np.asarray(grad)
            if g.ndim != 1 or g.size != self.n or g.dtype.kind != "f":
                return BAD_GRADIENT_CODE, g.size if g.ndim == 1 else -1, None
            return 0, 0, g.astype(np.float32, copy=False)
        except Exception:  # anything odd is bad input, reported on every rank
            return BAD_GRADIENT_CODE, -1, None

    def step(self, grad, tag=0):
        """Exchange this step's gradient; return the sum over ranks of what they kept.

        grad : 1-D float array of length n (cast to float32), this rank's gradient.
        tag : int every rank passes identically (a CRC of the layout).

        Returns a new float32 array of length n, bitwise identical on every rank. Bad
        input on any rank, or ranks disagreeing on n, rank, layout/parameters, tag or
        call count, raise ExchangeError on every rank before any data moves; if the
        exchange raises, the pipeline's state is left as it was.
        """
        if self._comm.closed:
            raise RuntimeError("PowerSGDPipeline is closed")
        before = self._comm.traffic
        code, detail, grad32 = self._local_error(grad)
        tag_value = tag_as_int64(tag)
        if tag_value is None:
            tag_value = 0
            code = code or TAG_ERROR_CODE
        plan = self.plan
        header = dict(error_code=code, error_detail=detail, n=self.n, algorithm=0, k=self.approx_rank,
                      call=self._calls, value_dtype=1, params=self._params_code,
                      count=plan.p_size + plan.dense_size, tag=tag_value)
        self._calls += 1  # on every rank, also when the call is rejected
        try:
            agree(self._comm, header, _ALGORITHM_NAMES)
        except ExchangeError as err:
            raise ExchangeError(str(err) + _HINT) from None

        acc = grad32 + self._residual if self.error_feedback else grad32
        blocks = plan.matrices
        p_size, q_size = plan.p_size, plan.q_size

        # Round 1: every P, then the dense vector, in one buffer.
        send = np.empty(p_size + plan.dense_size, np.float32)
        at = 0
        for i, block in enumerate(blocks):
            width = block.rows * block.rank
            send[at:at + width] = (self._matrix(acc, block) @ self._start_q(i, self.step_count)).ravel()
            at += width
        send[at:] = plan.dense_of(acc)
        summed = self._allreduce(send)

        # Round 2: every Q against the orthonormalised summed P.
        bases, q_local = [], np.empty(q_size, np.float32)
        at_p = at_q = 0
        for block in blocks:
            p = summed[at_p:at_p + block.rows * block.rank].reshape(block.rows, block.rank)
            basis, _ = orthonormalize(p)
            bases.append(basis)
            width = block.cols * block.rank
            q_local[at_q:at_q + width] = (self._matrix(acc, block).T @ basis).ravel()
            at_p += block.rows * block.rank
            at_q += width
        q_summed = self._allreduce(q_local)

        out = np.empty(self.n, np.float32)
        kept = np.empty(self.n, np.float32)
        new_q, at_q = [], 0
        for block, basis in zip(blocks, bases):
            width = block.cols * block.rank
            q_sum = q_summed[at_q:at_q + width].reshape(block.cols, block.rank)
            mine = q_local[at_q:at_q + width].reshape(block.cols, block.rank)
            at_q += width
            span = slice(block.offset, block.offset + block.size)
            out[span] = _outer_sum(basis, q_sum).ravel()[:block.size]
            # Local only (no agreement needed), so BLAS may do it.
            kept[span] = (basis @ mine.astype(np.float64).T).ravel()[:block.size]
            new_q.append(q_sum.copy())
        plan.put_dense(out, summed[p_size:])
        plan.put_dense(kept, send[p_size:])  # the dense part is kept whole

        # Commit (nothing above changed the state).
        if self.error_feedback:
            self._residual = acc - kept
        if self.warm_start:
            self._q = new_q
        self.last = PowerSGDStepInfo(self.step_count, kept, self._comm.traffic - before, len(blocks))
        self.step_count += 1
        return out

    def _allreduce(self, send):
        """Sum ``send`` over ranks (float32); skipped when empty (every rank has the same plan)."""
        out = np.empty_like(send)
        if send.size:
            self._comm.allreduce(send, out)
        return out

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        """numpy arrays and ints only: residual, warm-start Q's, step and call counters."""
        d = {"format": _STATE_FORMAT, "n": self.n, "params": self._params_code,
             "step": self.step_count, "calls": self._calls, "q_count": len(self._q),
             "residual": (self._residual.copy() if self._residual is not None
                          else np.empty(0, np.float32))}
        d.update({f"q_{i}": q.copy() for i, q in enumerate(self._q)})
        return d

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n, layout and parameters; each rank its own)."""
        mine = {"format": _STATE_FORMAT, "n": self.n, "params": self._params_code,
                "q_count": len(self._q)}
        for key, value in mine.items():
            if int(d.get(key, -1)) != value:
                raise ValueError(f"state_dict {key} is {d.get(key)!r}, this PowerSGD pipeline has "
                                 f"{value!r} (different n, layout or parameters)")
        qs = [np.asarray(d[f"q_{i}"], np.float32) for i in range(len(self._q))]
        for q, own in zip(qs, self._q):
            if q.shape != own.shape:
                raise ValueError(f"state_dict Q of shape {q.shape}, expected {own.shape}")
        residual = np.asarray(d["residual"], np.float32)
        if self.error_feedback and residual.shape != (self.n,):
            raise ValueError(f"state_dict residual has shape {residual.shape}, expected ({self.n},)")
        self._residual = residual.copy() if self.error_feedback else None
        self._q = [q.copy() for q in qs]
        self.step_count = int(d["step"])
        self._calls = int(d["calls"])
        self.last = None

    def close(self):
        """Free the duplicated communicator (idempotent)."""
        self._comm.free()

    def __repr__(self):
        return (f"PowerSGDPipeline(n={self.n}, rank={self.approx_rank}, "
                f"matrices={len(self.plan.matrices)}, dense={self.plan.dense_size}, "
                f"step={self.step_count})")


def _outer_sum(basis, q):
    """basis @ q.T in float64, as a fixed sequence of element-wise products and sums (no
    BLAS), so every rank turns the same (basis, q) into the same bits."""
    q = q.astype(np.float64)
    out = basis[:, :1] * q[:, 0]
    for j in range(1, basis.shape[1]):
        out += basis[:, j:j + 1] * q[:, j]
    return out
