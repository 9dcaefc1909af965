"""PowerSGD (Vogels, Karimireddy, Jaggi, NeurIPS'19), as PyTorch's DDP ``powerSGD_hook``.

One :class:`PowerSGDPipeline` holds what one fused gradient buffer of length ``n`` needs on
this rank from step to step: the error-feedback memory (:class:`~horovod_sparse.memory.ErrorFeedback`),
the warm-start Q of every compressed matrix, a step counter and a
:class:`~horovod_sparse.exchange.comm.CountingComm` (a duplicated communicator that counts
every byte). It is a :class:`~horovod_sparse.pipeline.Pipeline`, so the frontends drive it
as the others.

The buffer is numpy or a torch tensor on any device, and the step runs there
(:mod:`horovod_sparse.ops`; on CPU through numpy's kernels on zero-copy views,
:func:`~horovod_sparse.ops.views.kernel_view`); or an eager TensorFlow tensor (the
TensorFlow frontend's host call on a GPU, or with ``on_device``), and the step runs as
TensorFlow ops on its device: the same steps, the kernels of :mod:`.factors` returning new
tensors where numpy's write into the workspace (:func:`_joined`, :func:`_spliced` put the
pieces together). Only the factors cross to the host, for the two mpi4py Allreduces: P and
the dense vector out, their sum back (one transfer: as the orthonormal basis on numpy's and
TensorFlow's path); Q out, its sum back (one transfer: with the next step's start Q's on
numpy's and TensorFlow's path, which orthonormalise on the host).

One step, per compressed matrix M (a x b, see :mod:`.plan`; products in :mod:`.factors`),
with rank r:

1. M = gradient + residual (error feedback: ``memory.accumulate``, one pass; from the
   pieces of a step's gradients where the frontend gives them, read where they are,
   :mod:`.accumulate`);
2. Q <- orthonormalised Q (the summed Q of the previous step with warm start, else a
   fresh standard-normal draw; the first Q is a draw too). Draws come from
   ``np.random.default_rng([seed, matrix index, step])`` and so are identical on every
   rank. Orthonormalising Q first, as PyTorch does, keeps P at the scale of M instead
   of M M^T (it changes nothing else: the span of P is the same). The previous step
   computed them ahead and uploaded them with its Q sum;
3. P = M Q (float32); ONE Allreduce (sum) of all P matrices and the dense vector, float32;
4. P_orth = Gram-Schmidt(sum of P) (:mod:`.orthogonal`). On numpy's path and TensorFlow's,
   where the sum arrived: on the host, in float64 numpy without BLAS, so every rank gets the
   same bits whatever its device, library or thread count; rounded to float32 and sent to the
   device. On torch's own ops (a GPU, or the device path on the CPU) the sum crosses as it is
   and is orthonormalised there, in float32, one batched pass per run of one shape, as
   PyTorch's ``batched_powerSGD_hook`` does; the ranks' device kinds join the agreement's
   parameters, so ranks whose bits would differ (a mixed cluster) are refused, not let drift.
   Step 2's next start Q's are made the same way from the uploaded Q sum;
5. Q_local = M^T P_orth (float32); a second Allreduce (sum) of all Q matrices, float32;
6. result = P_orth (sum of Q)^T; this rank's share ``kept`` = P_orth Q_local^T (so the
   result is the sum over ranks of ``kept``, up to float32 rounding of the Q sum); both
   are r element-wise products summed in order (:func:`.factors.expand`), identical on
   every rank and in every library (TensorFlow included, given the same factors). The
   residual M - kept is written into the accumulated buffer chunk by chunk (kept never
   exists at size n; TensorFlow: a new buffer, a block at once), the dense part is
   cleared (``memory.commit_cleared``); the summed Q is the next step's warm start.

The dense part (1-D gradients, matrices too small or too thin to gain) is summed exactly
by the first Allreduce; its ``kept`` is the accumulated value and its residual zero.

On torch's own ops (a GPU, or the device path on the CPU) steps 3, 5 and 6 run once per run
of same-shape, equally spaced matrices (:mod:`.batched`: a batched product, the same
element-wise bits), and the dense part is gathered and scattered by one indexed copy each,
so a step's launches do not grow with its gradients; numpy and TensorFlow go matrix by matrix.

Across libraries: the products of steps 3 and 5 are each library's own float32 matmul
(BLAS for numpy, ``tf.matmul``, torch's), whose rounding may differ in the last bits, so a
TensorFlow step is close to a numpy step, not equal; everything else (the accumulate, the
dense sums, steps 4 and 6 from given sums) is the same float32 arithmetic in the same
order, so equal bit for bit. Every rank runs the same library on the same Allreduced sums,
so the result is bitwise identical across ranks either way.

Passes over the buffer per step: the accumulate (read 2, write 1), P = M Q and
Q = M^T P (read 1 each), the result (write 1, a new buffer) and the residual (read and
write acc once, the products staying in cache), and the overflow check (read 1).
TensorFlow's immutable tensors add copies (the slices and the concatenations that put a
buffer together), a pass or two each. On a CPU with the compiled kernels
(:mod:`horovod_sparse.ops.cpu.lowrank`, numpy or CPU torch buffers) the overflow check is
folded into the accumulate and the result and the residual are written in one pass: the
same bits as the numpy path, which stays the fallback and the reference. On a CPU either
way the result's buffer is the previous step's when the caller let go of it (no page faults).

Bytes (payload, counted by CountingComm's ring model, sent = received), per step:
``8 * (N1 - c(N1)) + 8 * (N2 - c(N2))`` with ``N1 = sum_m r_m a_m + dense_n`` (P's and the
dense vector), ``N2 = sum_m r_m b_m`` (Q's) and ``c(N) = floor((i+1)N/P) - floor(iN/P)``
this rank i's ring chunk, i.e. ``2(P-1)/P * 4 * (sum_m r_m (a_m + b_m) + dense_n)`` when P
divides N1 and N2. An empty Allreduce is skipped (no bytes, no message). On top of that,
control bytes: one Allgather of a 10-int64 agreement header, 80 (P-1) bytes each way.
"""
import functools
import sys
from typing import Optional

import numpy as np

from horovod_sparse.checks import check_bool, check_int
from horovod_sparse.exchange.comm import CountingComm
from horovod_sparse.errors import ExchangeError, NonFiniteGradientError
from horovod_sparse.exchange.validation import agree_call, identity_code
from horovod_sparse.memory import ErrorFeedback
from horovod_sparse.ops import cpu, host, namespace, views
from horovod_sparse.ops.cpu import lowrank as cpu_lowrank
from horovod_sparse.ops.pieces import as_piece, is_pieces
from horovod_sparse.pipeline import Pipeline, saved_array
from horovod_sparse.warmup import Warmup

from . import batched
from .accumulate import accumulate
from .factors import BlockView, back_project, expand_block, library, project, scratch_elements, transposed
from .orthogonal import orthonormalize, orthonormalize_batched
from .plan import make_plan

#: error code of this rank's header when its gradient is not a 1-D float array of length n
#: (``error_detail`` holds the length seen, -1 when it is not even 1-D)
BAD_GRADIENT_CODE = 20
_ERROR_TEXTS = {BAD_GRADIENT_CODE: "invalid input: grad is not a 1-D float array of length n "
                                   "(length {detail})"}
_ALGORITHM_NAMES = ("powersgd",)
_HINT = (" [PowerSGD: 'invalid input' = that rank's grad is not a 1-D float array of length n; "
         "'params' = the ranks' layouts (or rank, error_feedback, warm_start, seed, "
         "min_compression_rate) differ, or their gradients' devices are of different kinds "
         "(GPU models, CUDA or torch versions, CPU and GPU), whose orthonormalisations would differ]")
#: elements per chunk of rows when the result and residual are written on CPU (256 KiB:
#: the products stay in cache); other devices do a block at once
_CPU_CHUNK = 1 << 18


class PowerSGDStepInfo:
    """What one :meth:`PowerSGDPipeline.step` did on this rank.

    step : the step's number (0-based).
    kept : float32 length n, in the gradient's library and device, this rank's
        contribution: P_orth Q_local^T on compressed matrices, the accumulated gradient
        on the dense part. With error feedback, kept + new residual == gradient + old
        residual (up to one float32 rounding). Computed on first access, from the
        step's factors, by the code that wrote the residual (the same bits).
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    compressed_matrices : number of matrices exchanged as P and Q.
    """

    def __init__(self, step, traffic, compressed_matrices, make_kept):
        self.step, self.traffic, self.compressed_matrices = step, traffic, compressed_matrices
        self._make_kept, self._kept = make_kept, None

    @property
    def kept(self):
        if self._kept is None:
            self._kept = self._make_kept()
        return self._kept


class _Workspace:
    """The buffers of a pipeline, allocated once per library and device of the gradient.

    On the device (the gradient's library): ``send`` (the P's then the dense vector),
    ``q_send``, ``dense_positions`` and ``scratch`` for :func:`expand_block`. On the host
    (numpy, for mpi4py): ``p_summed``, ``q_summed``, ``basis`` (the orthonormalised summed
    P's, float32) and ``start`` (the orthonormalised start Q's). TensorFlow: no device
    buffers but ``dense_positions`` (its kernels return new tensors), ``send``, ``q_send``
    and ``scratch`` are None.
    """

    def __init__(self, plan, like, runs):
        p, q, dense = plan.p_size, plan.q_size, plan.dense_size
        self.dense_positions = _moved(plan.dense_positions(), like)
        self.p_summed, self.q_summed = np.empty(p + dense, np.float32), np.empty(q, np.float32)
        self.basis, self.start = np.empty(p, np.float32), np.empty(q, np.float32)
        if namespace.is_tensorflow(like):
            self.send = self.q_send = None
            self.chunk, self.scratch = 0, (None, None)
            return
        self.send = namespace.empty(p + dense, "float32", like)
        self.q_send = namespace.empty(q, "float32", like)
        on_cpu = namespace.host_shortcut_allowed(like)
        # the device: a matrix, or a run's matrices up to batched.RUN_CHUNK elements, per launch
        self.chunk = _CPU_CHUNK if on_cpu else max([b.rows * b.cols for b in plan.matrices] + [batched.RUN_CHUNK])
        size = max(scratch_elements(plan.matrices, self.chunk), batched.scratch_elements(runs, self.chunk))
        self.scratch = (namespace.empty(size, "float32", like), namespace.empty(size, "float32", like))


class PowerSGDPipeline(Pipeline):
    """State of one PowerSGD-compressed gradient buffer of length ``n`` on this rank (a
    :class:`~horovod_sparse.pipeline.Pipeline`).

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
    warmup_steps : int >= 0 (default 0)
        The first warmup_steps steps sum the whole of acc by one Allreduce and clear the
        residual (:meth:`_dense_step`); the ranks agree on it in the call's header.

    Attributes: ``n``, ``plan`` (:class:`~.plan.Plan`), ``approx_rank``, ``step_count``,
    ``residual`` (float32 length n in the gradient's library, or None without error
    feedback), ``last`` (:class:`PowerSGDStepInfo`, None before the first step),
    ``traffic`` (cumulative), ``world_rank``, ``world_size``, ``numpy_on_cpu`` (True: CPU
    tensors run numpy's kernels on zero-copy views, the same bits as numpy input; False
    runs torch's, as on a GPU).

    Guarantee (tested): span(P) = span((sum_i M_i) Q), so when the sum over ranks of the
    accumulated matrices has rank <= r the result is that sum, in exact arithmetic. In
    float32 the error grows with the conditioning of V^T Q (V: the sum's row space):
    the first step (a random Q) reconstructs any rank-r sum to float32 accuracy, and
    with warm start so does every later step while the row space stays put (the summed
    Q then spans it). Fresh spaces every step with a warm Q are not covered.
    """

    def __init__(self, n, comm, rank, layout=None, error_feedback=True, warm_start=True, seed=0,
                 min_compression_rate=2.0, warmup_steps=0):
        self.n = check_int("n", n, 0)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, 0, 2 ** 31 - 1)
        self.warmup = Warmup(self.warmup_steps, ramp=False)  # dense steps only: the factors have no density
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
        self._params_code = identity_code(
            self.plan.signature(), None if layout is None else layout.tag, self.error_feedback,
            self.warm_start, self.seed, self.min_compression_rate)
        self._spans = _factor_spans(self.plan)
        # the device path's view of the same matrices: runs of one shape, a launch per run
        self._runs, self._unbatched = batched.make_runs(self._spans)

        self._comm = CountingComm(comm)  # collective: after every local check
        self._exchanges = (self._comm,)
        self.world_rank, self.world_size = self._comm.rank, self._comm.size
        self._memory = ErrorFeedback(self.n, self.error_feedback)
        self._q = [self._draw(i, 0) for i in range(len(self.plan.matrices))]
        # the last Q sum where it was handed to MPI as a device buffer, newer than _q: the host
        # reads it only when it must (_warm_start_qs), so that a step crosses nothing
        self._q_sum_on_device = None
        # the next step's start Q's, already where its gradient lives: a step uploads them with
        # its Q sum (one transfer fewer); ((step, where), start), None when nothing is ahead
        self._start_ahead = None
        self._calls = 0
        self._results = views.ReusedResult(self.n)  # step 6's output on the CPU
        self.last: Optional[PowerSGDStepInfo] = None

    # ------------------------------------------------------------------ state
    @property
    def residual(self):
        return self._memory.residual if self.error_feedback else None

    @property
    def q_matrices(self):
        """The Q of every compressed matrix the next step starts from (float32 numpy, cols x r)."""
        return list(self._warm_start_qs())

    def _warm_start_qs(self):
        """The warm-start Q's on the host (float32 numpy, cols x r each), brought down first if
        the last step left its Q sum on the device."""
        if self._q_sum_on_device is not None:
            q_sum = host.to_host(self._q_sum_on_device)
            self._q = [q_sum[q_span].reshape(block.cols, block.rank).copy() for block, _, q_span in self._spans]
            self._q_sum_on_device = None
        return self._q

    def _draw(self, index, step):
        block = self.plan.matrices[index]
        rng = np.random.default_rng([self.seed, index, step])
        return rng.standard_normal((block.cols, block.rank)).astype(np.float32)

    def _start_q(self, index, step, qs):
        """The orthonormal Q ``step`` multiplies M by (identical on every rank), from the
        warm-start Q's ``qs``."""
        q = qs[index] if self.warm_start else self._draw(index, step)
        basis, zero_columns = orthonormalize(q)
        if zero_columns:
            # A zero summed Q (e.g. a zero gradient) would stay zero forever: draw anew.
            basis, _ = orthonormalize(self._draw(index, step))
        return basis

    def _starts(self, step, qs, out):
        """Every matrix's start Q for ``step`` into the host buffer ``out`` (returned)."""
        for i, (block, _, q_span) in enumerate(self._spans):
            out[q_span] = self._start_q(i, step, qs).ravel()
        return out

    def _start_for(self, acc, ws):
        """Step 2's start Q's where acc lives: those the previous step uploaded for this step,
        else computed and uploaded now (the first step, after a warm-up or a restore)."""
        if self._start_ahead is not None and self._start_ahead[0] == _place(self.step_count, acc):
            return self._start_ahead[1]
        lib = library(self._kernel(acc))  # numpy's on a CPU tensor that takes numpy's kernels
        q_flat = ws.q_summed  # the warm-start Q's as a Q sum arrives: in factor order
        qs = self._warm_start_qs()
        for (_, _, q_span), q in zip(self._spans, qs):
            q_flat[q_span] = q.ravel()
        if self._starts_on_device(lib, q_flat):  # as a step ahead makes them from its Q sum
            return self._orthonormalized(lib, namespace.copy_of(host.from_host(q_flat, acc)), "q")
        return host.from_host(self._starts(self.step_count, qs, ws.start), acc)

    def _starts_on_device(self, lib, q_flat):
        """Whether step 2's start Q's are orthonormalised on the device (torch's own ops, from the
        warm-start Q's ``q_flat``, host float32 in factor order): not when they are fresh draws
        (drawn on the host), nor when a Q has a zero column, which the host's code redraws
        (a zero gradient; found on the host's copy, not by a read-back)."""
        if not (_batches(lib) and self.warm_start):
            return False
        return not any(np.any(np.all(_factor(q_flat, q_span, block.cols) == 0, axis=0))
                       for block, _, q_span in self._spans)

    def _zero_column(self, lib, q_sum):
        """Whether a Q in the flat device buffer ``q_sum`` (factor order) has a zero column, which
        :meth:`_start_q` would redraw on the host: one read-back, per run of one shape, none per
        gradient."""
        found = [(batched.factor(q_sum, run.q, run, run.cols) == 0).all(1).any() for run in self._runs]
        found += [(_factor(q_sum, q_span, block.cols) == 0).all(0).any() for block, _, q_span in self._unbatched]
        return bool(host.to_list(lib.stack(found).any())) if found else False

    def _orthonormalized(self, lib, flat, which):
        """Step 4's or step 2's Gram-Schmidt on the device: the P's (``which`` "p") or Q's ("q")
        in the flat torch buffer ``flat``, in place, one batched pass per run of one shape
        (:func:`.orthogonal.orthonormalize_batched`); returns ``flat``."""
        for run in self._runs:
            span, rows = (run.p, run.rows) if which == "p" else (run.q, run.cols)
            orthonormalize_batched(lib, batched.factor(flat, span, run, rows))
        for block, p_span, q_span in self._unbatched:
            span, rows = (p_span, block.rows) if which == "p" else (q_span, block.cols)
            orthonormalize_batched(lib, _factor(flat, span, rows)[None])
        return flat

    # ------------------------------------------------------------------- step
    def _checked(self, grad):
        """(error code, detail, grad as contiguous float32 or None): reported by the agreement.
        Pieces stay pieces (checked, read where they are; TensorFlow's are fused here, as
        float32), their detail the total length."""
        try:
            if is_pieces(grad):
                pieces = [as_piece(piece) for piece in grad]
                if any(piece is None for piece in pieces):
                    return BAD_GRADIENT_CODE, -1, None
                total = sum(int(piece.shape[0]) for piece in pieces)
                if total != self.n:
                    return BAD_GRADIENT_CODE, total, None
                if not pieces:
                    return 0, 0, np.empty(0, np.float32)
                if any(namespace.is_tensorflow(piece) for piece in pieces):
                    return 0, 0, namespace.concat_float32(pieces)
                return 0, 0, pieces
            if namespace.is_tensorflow(grad):
                tf = sys.modules["tensorflow"]
                if grad.shape.rank != 1 or grad.shape[0] != self.n or not grad.dtype.is_floating:
                    return BAD_GRADIENT_CODE, int(grad.shape[0]) if grad.shape.rank == 1 else -1, None
                return 0, 0, tf.cast(grad, tf.float32)
            if namespace.is_torch(grad):
                g = grad.detach()
                if g.dim() != 1 or g.numel() != self.n or not g.is_floating_point():
                    return BAD_GRADIENT_CODE, g.numel() if g.dim() == 1 else -1, None
                return 0, 0, g.to(namespace.dtype_of(g, "float32")).contiguous()
            g = np.asarray(grad)
            if g.ndim != 1 or g.size != self.n or g.dtype.kind != "f":
                return BAD_GRADIENT_CODE, g.size if g.ndim == 1 else -1, None
            return 0, 0, np.ascontiguousarray(g, dtype=np.float32)
        except Exception:  # anything odd is bad input, reported on every rank
            return BAD_GRADIENT_CODE, -1, None

    fresh_result = True  # step 6 allocates the result
    takes_pieces = True  # step 1 reads a step's gradients where they are (no fused copy)

    def step(self, grad, tag=0, finite=True):
        """Exchange this step's gradient; return the sum over ranks of what they kept.

        grad : 1-D float buffer of length n (numpy, a torch tensor on any device, or an
            eager TensorFlow tensor; cast to float32), this rank's gradient; or a list of 1-D
            float pieces that are that buffer back to back (a step's gradients, flattened),
            read where they are (the same bits as their concatenation cast to float32).
            Never modified.
        tag : int every rank passes identically (a CRC of the layout).
        finite : False when another gradient of this rank's step overflowed (the step is
            skipped on every rank, as for an overflow here).

        Returns a new float32 buffer of length n in grad's library and device, bitwise
        identical on every rank. Bad input on any rank (pieces of another total length
        included), or ranks disagreeing on n, rank, layout/parameters, tag or call count,
        raise ExchangeError (a ValueError, naming each rank's n) on every rank before any
        data moves; if the exchange raises, the pipeline's state is left as it was (so it
        is when any rank's M holds an inf or a NaN: NonFiniteGradientError on every rank).
        """
        if self._comm.closed:
            raise RuntimeError("PowerSGDPipeline is closed")
        before = self._comm.traffic
        code, detail, grad = self._checked(grad)
        plan = self.plan
        acc, acc_finite = self._accumulate(grad)                                    # step 1
        fused = acc is not None and self._fused_on(acc)
        call, self._calls = self._calls, self._calls + 1  # on every rank, also when rejected
        dense = self.warmup.phase(self.step_count) == "dense"
        # the device path orthonormalises on each rank's device: its kind joins what every rank must share
        params = self._params_code if acc is None else _with_device_kind(self._params_code, self._kernel(acc))
        try:
            agree_call(self._comm, n=self.n, call=call, tag=tag, params=params,
                       error_code=code, error_detail=detail, k=self.approx_rank,
                       count=self.n if dense else plan.p_size + plan.dense_size, algorithm_names=_ALGORITHM_NAMES,
                       exchange="PowerSGD", error_texts=_ERROR_TEXTS, finite=acc is None or (finite and acc_finite()))
        except NonFiniteGradientError:
            self._calls = call  # a skipped step is not counted: the next runs as if it had not been
            raise
        except ExchangeError as err:
            raise ExchangeError(str(err) + _HINT) from None
        if dense:
            return self._dense_step(acc, before)

        ws = self._workspace_for(acc)
        kernel = self._kernel
        m = kernel(acc)
        lib = library(m)  # None on TensorFlow: the kernels return new tensors, ws has no buffers

        start = kernel(self._start_for(acc, ws))                                    # step 2

        send = kernel(ws.send)                                                      # step 3
        p_local = self._products(lib, m, start, send, project)
        dense = _gather_dense(plan, m, _part(send, slice(plan.p_size, None)), ws.dense_positions)
        send = _joined(ws.send, p_local + [dense], acc)
        p_summed = self._allreduce(host.to_wire(send, self._comm), ws.p_summed)

        if _batches(lib):                                                           # step 4
            summed = host.from_wire(p_summed, acc)  # one transfer (none if handed): the P sums, the dense sum
            basis, dense_sum = self._orthonormalized(lib, summed[:plan.p_size], "p"), summed[plan.p_size:]
        else:
            for block, p_span, _ in self._spans:
                basis, _ = orthonormalize(p_summed[p_span].reshape(block.rows, block.rank))
                ws.basis[p_span] = basis.ravel()
            basis, dense_sum = host.from_host_packed((ws.basis, p_summed[plan.p_size:]), acc)  # one transfer

        q_send = kernel(ws.q_send)                                                  # step 5
        q_local = _joined(ws.q_send, self._products(lib, m, kernel(basis), q_send, back_project), acc)
        q_summed = self._allreduce(host.to_wire(q_local, self._comm), ws.q_summed)
        # step 2, ahead: this step's start Q's are used, their buffer takes the next step's (on
        # the host's path the start kept ahead may be that buffer: forgotten until the step ends)
        self._start_ahead = None
        if not isinstance(q_summed, np.ndarray) and self.warm_start and not self._zero_column(lib, q_summed):
            # handed to MPI as a device buffer: the Q sum stays there, read by the host only if
            # it must (a checkpoint, a restart: _warm_start_qs)
            q_sum, next_q = host.from_wire(q_summed, acc), None
            next_start = self._orthonormalized(lib, namespace.copy_of(q_sum), "q")
        else:
            q_summed = host.to_host(q_summed)  # a handed Q sum comes down (a zero column to redraw)
            next_q = [q_summed[q_span].reshape(block.cols, block.rank) for block, _, q_span in self._spans]
            if self._starts_on_device(lib, q_summed):  # orthonormalised where they are used, from the Q sum
                q_sum = host.from_host(q_summed, acc)  # one transfer
                next_start = self._orthonormalized(lib, namespace.copy_of(q_sum), "q")
            else:
                next_start = self._starts(self.step_count + 1, next_q, ws.start)
                q_sum, next_start = host.from_host_packed((q_summed, next_start), acc)  # one transfer

        # Step 6 in the buffer's own library: element-wise work, where torch's CPU kernels
        # beat numpy's broadcasting ones (4096 x 2048 outer product: 1 vs 4 ms).
        out = self._result(acc)                                                     # step 6
        if fused:  # the result and the residual in one pass
            self._expand_fused(out, acc, basis, q_sum, q_local)
            _scatter_dense(plan, dense_sum, out, ws.dense_positions)
        else:
            out = _spliced(out, self._expand(out, basis, q_sum, ws)
                           + _scatter_dense(plan, dense_sum, out, ws.dense_positions))
        factors = tuple(namespace.copy_of(x) for x in (basis, q_local, _part(send, slice(plan.p_size, None))))
        if self.error_feedback:
            if not fused:
                acc = _spliced(acc, self._expand(acc, basis, q_local, ws, subtract=True))
            self._memory.commit_cleared(acc, ws.dense_positions)
        if self.warm_start:
            self._q, self._q_sum_on_device = ((self._q, q_sum) if next_q is None
                                              else ([q.copy() for q in next_q], None))
        self._start_ahead = (_place(self.step_count + 1, acc), next_start)
        self.last = PowerSGDStepInfo(self.step_count, self._comm.traffic - before, len(plan.matrices),
                                     lambda: self._kept(ws, *factors))
        self.step_count += 1
        return out

    def _new_workspace(self, like):
        return _Workspace(self.plan, like, self._runs)

    def _products(self, lib, m, factors, out, product):
        """Step 3 (``product`` :func:`.factors.project`: P = M Q, ``factors`` the start Q's, ``out``
        the P buffer) or step 5 (:func:`.factors.back_project`: Q = M^T P, ``factors`` the basis,
        ``out`` the Q buffer) for every matrix of ``m``. Returns the new factors in the order of
        their places in the buffer (TensorFlow: :func:`_joined` puts them together); numpy and
        torch write them into ``out`` and return []. Torch runs one batched product per run of
        same-shape matrices (:mod:`.batched`), as on a GPU."""
        forward = product is project
        spans = self._spans
        if _batches(lib):
            batched_product = batched.project if forward else batched.back_project
            for run in self._runs:
                a_rows, b_rows = (run.cols, run.rows) if forward else (run.rows, run.cols)
                a_span, b_span = (run.q, run.p) if forward else (run.p, run.q)
                batched_product(lib, batched.matrices(m, run), batched.factor(factors, a_span, run, a_rows),
                                batched.factor(out, b_span, run, b_rows))
            spans = self._unbatched
        made = []
        for block, p_span, q_span in spans:
            a_span, a_rows, b_span, b_rows = ((q_span, block.cols, p_span, block.rows) if forward
                                              else (p_span, block.rows, q_span, block.cols))
            made.append((b_span.start, product(lib, BlockView(m, block), _factor(factors, a_span, a_rows),
                                                _factor(out, b_span, b_rows))))
        return [] if lib is not None else [factor for _, factor in sorted(made, key=lambda made: made[0])]

    def regime(self):
        """The warm-up's phase at the next step, in words (for reports)."""
        return self.warmup.describe(self.step_count, f"rank {self.approx_rank}")

    def _dense_step(self, acc, before):
        """A warm-up step (PyTorch's ``start_powerSGD_iter``): acc summed whole by one Allreduce,
        the residual cleared; no factor changes (the first compressed step starts from the
        initial Q's, as without a warm-up)."""
        sent = np.array(host.to_host(acc), np.float32, copy=True)
        out = host.from_host(self._allreduce(sent, np.empty(self.n, np.float32)), acc)
        if self.error_feedback:
            self._memory.commit_cleared(acc, namespace.arange(self.n, acc))
        self.last = PowerSGDStepInfo(self.step_count, self._comm.traffic - before, 0,
                                     lambda: host.from_host(sent, out))
        self.step_count += 1
        return out

    # ------------------------------------------------- fused CPU kernels
    def _fused_on(self, acc):
        """Whether step 6 runs the compiled kernels (:mod:`horovod_sparse.ops.cpu.lowrank`):
        they are enabled and acc is numpy or a CPU tensor run through numpy."""
        return cpu.enabled() and self.numpy_on_cpu and views.numpy_view(acc) is not None

    def _accumulate(self, grad):
        """Step 1: ``(acc, finite)``, ``finite()`` telling whether acc is all finite
        (:func:`.accumulate.accumulate`: with the kernels, acc is written into the residual's
        spare and checked in the same pass, piece by piece where grad is pieces; the numpy
        path accumulates, and checks in a pass of its own when asked). The state is untouched."""
        if grad is None:
            return None, lambda: True
        return accumulate(self._memory, grad, self.numpy_on_cpu)

    def _expand_fused(self, out, acc, basis, q_sum, q_local):
        """Step 6 by the kernel: every block's result ``basis q_sum^T`` into ``out`` and, with
        error feedback, ``acc -= basis q_local^T`` (numpy views of CPU buffers; the same bits
        as :meth:`_expand` twice)."""
        out, acc = views.numpy_view(out), views.numpy_view(acc)
        basis, q_sum, q_local = (self._kernel(x) for x in (basis, q_sum, q_local))
        for block, p_span, q_span in self._spans:
            view = BlockView(None, block)
            part = slice(block.offset, block.offset + block.size)
            cpu_lowrank.expand_residual(
                out[part], acc[part], transposed(_factor(basis, p_span, block.rows)),
                transposed(_factor(q_sum, q_span, block.cols)), transposed(_factor(q_local, q_span, block.cols)),
                view.full, block.cols, view.tail_size, self.error_feedback)

    def _result(self, like):
        """Step 6's output buffer: on the CPU the previous step's once nothing refers to it
        (:class:`~horovod_sparse.ops.views.ReusedResult`); other devices, torch's own kernels
        and TensorFlow: :func:`_new_result`."""
        out = self._results.like(like) if self.numpy_on_cpu else None
        return _new_result(self.n, like) if out is None else out

    def _expand(self, target, basis, q, ws, subtract=False):
        """For every matrix: target's block = (or -=) basis q^T (see :func:`.factors.expand_block`).
        Returns the parts for :func:`_spliced`: ``(offset, new values)`` per block (TensorFlow;
        numpy and torch wrote them into target, their values are None)."""
        lib = library(target)
        spans = self._spans
        if _batches(lib):  # a launch per run (a few per run on huge ones), as on a GPU
            for run in self._runs:
                for first, count in batched.chunks(run, ws.chunk):
                    batched.expand(lib, batched.matrices(target, run, first, count),
                                   batched.factor(basis, run.p, run, run.rows, first, count),
                                   batched.factor(q, run.q, run, run.cols, first, count), ws.scratch, subtract)
            spans = self._unbatched
        return [(block.offset,
                 expand_block(lib, BlockView(target, block), transposed(_factor(basis, p_span, block.rows)),
                              transposed(_factor(q, q_span, block.cols)), ws.scratch, ws.chunk,
                              subtract=subtract))
                for block, p_span, q_span in spans]

    def _kept(self, ws, basis, q_local, dense):
        """This rank's contribution, from the step's factors (see :class:`PowerSGDStepInfo`)."""
        kept = _new_result(self.n, basis)  # basis is in the gradient's library and device
        return _spliced(kept, self._expand(kept, basis, q_local, ws)
                        + _scatter_dense(self.plan, dense, kept, ws.dense_positions))

    def _allreduce(self, send, out):
        """Sum ``send`` over ranks (float32) into the host buffer ``out``, or beside ``send`` where
        it is a device buffer handed to MPI as it is (:meth:`CountingComm.allreduce`); skipped when
        empty (every rank has the same plan)."""
        if send.shape[0]:
            return self._comm.allreduce(send, out)
        return out if isinstance(send, np.ndarray) else send

    # ------------------------------------------------------------ checkpoints
    def _identity(self):
        """Also the layout and parameters (as one code) and the number of matrices."""
        return {**super()._identity(), "params": self._params_code, "q_count": len(self._q)}

    def _own_state(self):
        """The call counter, the residual (empty without error feedback), the warm-start Q's."""
        residual = self._memory.state_dict()["residual"] if self.error_feedback else np.empty(0, np.float32)
        d = {"calls": self._calls, "residual": residual}
        d.update({f"q_{i}": q.copy() for i, q in enumerate(self._warm_start_qs())})
        return d

    def _load_own_state(self, state):
        qs = [saved_array(state, f"q_{i}", own.shape) for i, own in enumerate(self._q)]
        if self.error_feedback:
            self._memory.load_state_dict({"residual": saved_array(state, "residual", (self.n,))})
        self._q, self._q_sum_on_device = [q.copy() for q in qs], None
        self._start_ahead = None
        self._calls = int(state["calls"])

    def __repr__(self):
        return (f"PowerSGDPipeline(n={self.n}, rank={self.approx_rank}, warmup_steps={self.warmup_steps}, "
                f"matrices={len(self.plan.matrices)}, dense={self.plan.dense_size}, "
                f"step={self.step_count})")


def _place(step, acc):
    """What a start Q computed ahead is valid for: the step, and the library and device of the
    gradient it was uploaded beside."""
    return step, type(acc), getattr(acc, "device", None)


def _factor_spans(plan):
    """(block, its P's slice of the P buffer, its Q's slice of the Q buffer), in plan order.

    The factors lie in the buffers by shape: the matrices of one ``(rows, cols, rank)`` back to
    back, in buffer order, the shapes in the order they first appear; so same-shape matrices
    that are not neighbours in the plan (a transformer's layers: each layer's shapes, then the
    next layer's) still have adjacent factors, and torch's device path takes them in one batched
    product (:func:`.batched.make_runs`). The order only places the factors in the Allreduces'
    buffers (an element's sum is the same whatever its place, but for the order P > 2 ranks add
    it in)."""
    first_seen = {}
    for block in plan.matrices:
        first_seen.setdefault((block.rows, block.cols, block.rank), len(first_seen))
    order = sorted(range(len(plan.matrices)), key=lambda i: (
        first_seen[(plan.matrices[i].rows, plan.matrices[i].cols, plan.matrices[i].rank)], plan.matrices[i].offset))
    spans, at_p, at_q = [None] * len(plan.matrices), 0, 0
    for i in order:
        block = plan.matrices[i]
        spans[i] = (block, slice(at_p, at_p + block.rows * block.rank), slice(at_q, at_q + block.cols * block.rank))
        at_p += block.rows * block.rank
        at_q += block.cols * block.rank
    return spans


def _factor(flat, span, rows):
    """The (rows, r) factor at ``span`` of a flat factor buffer (a view); None for no buffer
    (TensorFlow: the kernels make their own)."""
    if flat is None:
        return None
    if not isinstance(flat, np.ndarray) and namespace.is_tensorflow(flat):
        return sys.modules["tensorflow"].reshape(flat[span], [rows, -1])
    return flat[span].reshape(rows, -1)


def _part(flat, span):
    """``flat[span]`` (a view), None for no buffer."""
    return None if flat is None else flat[span]


def _with_device_kind(params, m):
    """The header's ``params`` code for a step whose kernels run on ``m``: as it is on the host's
    path (numpy, TensorFlow), where the orthonormalisation gives the same bits anywhere; on torch's
    own ops, with the device's kind (GPU model, CUDA and torch versions; on the CPU torch's
    version and threads) folded in, since each rank orthonormalises on its own device: ranks
    that would get different bits (a mixed cluster) stop with an ExchangeError on every rank
    instead of drifting apart."""
    if not _batches(library(m)):
        return params
    torch = sys.modules["torch"]
    threads = torch.get_num_threads() if m.device.type == "cpu" else 0
    return identity_code(params, _device_kind(str(m.device), threads))


@functools.lru_cache(maxsize=None)
def _device_kind(device, threads):
    """What decides a device's float32 bits: the GPU's model and CUDA version, torch's version,
    and on the CPU the threads a reduction may be split over."""
    torch = sys.modules["torch"]
    model = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    return model, torch.version.cuda, torch.__version__, threads


def _batches(lib):
    """Whether the kernels run batched over runs (:mod:`.batched`): torch's own ops, the device
    path; numpy keeps its per-matrix BLAS calls and compiled kernels, TensorFlow its own ops."""
    return lib is not None and lib is not np


def _gather_dense(plan, buffer, dense, positions):
    """Copy the dense slices of ``buffer`` back to back into ``dense``; returns ``dense``
    (TensorFlow: a new tensor of them, ``dense`` None). Torch: one gather by ``positions``
    (the plan's :meth:`~.plan.Plan.dense_positions` on the device), not a copy per slice."""
    if namespace.is_tensorflow(buffer):
        tf = sys.modules["tensorflow"]
        return tf.concat([buffer[a:b] for a, b in plan.dense_slices], 0) if plan.dense_slices else buffer[:0]
    if namespace.is_torch(buffer) and plan.dense_slices:
        return sys.modules["torch"].index_select(buffer, 0, positions, out=dense)
    at = 0
    for a, b in plan.dense_slices:
        dense[at:at + b - a] = buffer[a:b]
        at += b - a
    return dense


def _scatter_dense(plan, dense, buffer, positions):
    """The inverse of :func:`_gather_dense`: the dense vector into its places in ``buffer``.
    Returns the parts for :func:`_spliced`, ``(offset, values)`` (TensorFlow: written nowhere,
    ``buffer`` may be None; torch: one scatter by ``positions``, no parts)."""
    if namespace.is_torch(buffer):
        if plan.dense_slices:
            buffer.index_copy_(0, positions, dense)
        return []
    parts, at, write = [], 0, not namespace.is_tensorflow(dense)
    for a, b in plan.dense_slices:
        parts.append((a, dense[at:at + b - a]))
        if write:
            buffer[a:b] = parts[-1][1]
        at += b - a
    return parts


def _new_result(n, like):
    """A new float32 buffer of ``n`` elements for step 6 to write into, in ``like``'s library and
    device; TensorFlow: None (the result is :func:`_spliced` from the parts, which cover the
    buffer), a zero-length tensor when there are none (n = 0)."""
    if namespace.is_tensorflow(like) and n:
        return None
    return namespace.new_empty(n, "float32", like)


def _joined(buffer, parts, like):
    """The factors of one Allreduce, back to back: ``buffer`` (numpy, torch), which the kernels
    wrote ``parts`` into; TensorFlow (``buffer`` None): ``parts`` flattened into one new tensor
    on ``like``'s device (empty without parts)."""
    if buffer is not None:
        return buffer
    if not parts:
        return namespace.zeros(0, "float32", like)
    tf = sys.modules["tensorflow"]
    return tf.concat([tf.reshape(part, [-1]) for part in parts], 0)


def _spliced(target, parts):
    """``target`` with ``parts`` (``(offset, 1-D values)``) in their places. numpy and torch:
    ``target`` itself, the kernels wrote the parts into it. TensorFlow: one new tensor, the
    parts in offset order with ``target``'s elements between them (``target`` None: the parts
    cover the buffer)."""
    if not parts or not namespace.is_tensorflow(parts[0][1]):
        return target
    tf = sys.modules["tensorflow"]
    pieces, at = [], 0
    for offset, values in sorted(parts, key=lambda part: part[0]):
        if offset > at:
            pieces.append(target[at:offset])
        pieces.append(values)
        at = offset + int(values.shape[0])
    if target is not None and at < int(target.shape[0]):
        pieces.append(target[at:])
    return tf.concat(pieces, 0)


def _moved(array, like):
    """A numpy array (setup data, not per-step traffic) in ``like``'s library and device."""
    if namespace.is_tensorflow(like):
        tf = sys.modules["tensorflow"]
        with tf.device(like.device):
            return tf.constant(array)
    if not namespace.is_torch(like):
        return array
    import torch
    return torch.from_numpy(array).to(like.device)
