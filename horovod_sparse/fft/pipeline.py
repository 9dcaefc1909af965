"""The FFT pipeline: error feedback -> chunked rfft -> drop low-energy coefficients ->
range-based float codes -> sparse allreduce of the spectrum -> inverse rfft -> residual.

FFT-based gradient sparsification (Wang et al., HPDC'20). The buffer is numpy or a torch
tensor on any device and the step runs there (:mod:`horovod_sparse.ops`; CPU
tensors through numpy's kernels on zero-copy views, the same bits as numpy input), or an
eager TensorFlow tensor (the TensorFlow frontend's host call on a GPU or with
``on_device=True``: every step below as TensorFlow ops on its device, each kernel returning
a new tensor). Only the kept (position, value) pairs cross to the host, into the sparse
engine (which makes and exchanges the range codes), and the summed pairs come back. Per
step on every rank:

1. acc = grad + residual (``memory.accumulate``: one pass; acc = grad without error feedback);
   from the pieces of a step's gradients where the frontend gives them, read where they are
   (:mod:`horovod_sparse.lowrank.accumulate`; without error feedback acc is then the pieces
   fused into a reused buffer);
2. S = the chunked real spectrum of acc (:class:`.spectrum.ChunkedSpectrum`: float32 rfft,
   norm="ortho", of ``chunk_size``-element chunks, the last one shorter), a float32
   vector of 2 * C values (C complex coefficients, re and im interleaved), in a buffer
   reused from step to step;
3. keep the C - floor(theta * C) coefficients of largest energy (|X|**2 weighted by
   Parseval, i.e. the coefficient's share of the signal's energy; ties to the lower
   position) and drop the others: theta is the FRACTION OF COEFFICIENTS DROPPED,
   in [0, 1), so at least one coefficient is kept; both the re and im of a kept
   coefficient are sent. The selection is exact, found among candidates above a
   bound carried across steps (:mod:`.selection`: one comparison pass, one compaction
   and a partition of about 1.5 k keys, most steps);
4. exchange the kept (position, value) pairs through
   :class:`~horovod_sparse.exchange.SparseAllreduce` ("allgather", or "oktopk" with
   k = 2 * kept entries, i.e. the kept re/im count), values carried as
   :class:`~horovod_sparse.quantize.rangefloat.RangeFloatCodec` codes, summing over ranks;
5. result = the inverse chunked rfft of the summed spectrum (scattered into the zeroed
   spectrum buffer): float32, length n, bitwise identical on every rank (same bytes in,
   same arithmetic);
6. residual = acc - irfft(K), K = this rank's kept spectrum AS DECODED from its codes,
   restricted for "oktopk" to what the global selection kept (local ∩ global), so the
   quantization error and whatever was dropped stay in the residual
   (``memory.commit_minus``; irfft(K) is computed into the result's buffer first).

Passes over n per step: the accumulate, the two transforms' worth of reading and writing
(forward; the inverse twice with error feedback), the energies (read S, write C keys),
one comparison and one compaction over the keys, zeroing S (twice), the residual's
subtraction and the overflow check. With the compiled kernels (:mod:`horovod_sparse.ops.cpu`;
numpy or CPU torch buffers) the overflow check is folded into the accumulate and the
energies are one pass from S to the keys; the same bits (the transforms stay pocketfft).

TensorFlow's transforms (``tf.signal``) are not pocketfft's bit for bit: a TensorFlow step
agrees with a numpy step to float32 FFT rounding (relative L2 ~1e-7 per transform, inside
the 2**-20 below), and selects and codes the same where that rounding does not cross a
selection threshold or a code's rounding boundary. Every rank still returns the same bits
(the same summed pairs through the same TensorFlow ops).

The FFT is linear, so (up to float rounding) the result is the sum over ranks of
irfft(K_r): the step's ``last.kept``.

Conservation: ``last.kept + new residual == acc`` up to one float32 rounding of the
subtraction: elementwise ``|kept + residual - acc| <= 2**-23 * (|acc| + |kept|)``.

Error of a step against the exact sum (theta = 0, all coefficients kept, "allgather"):
the transform is orthonormal, so the time-domain L2 error of rank r's contribution is at
most sqrt(2) times the L2 error of its spectrum codes, itself at most
2**-(m+1) * ||S_r|| + the flushed values (2**-(m+1) is the codec's relative bound, see
:mod:`horovod_sparse.quantize.rangefloat`), plus float32 rounding of the transforms
(measured relative L2 error of a float32 forward + inverse here: 1.5e-7, well inside
2**-20 = 9.5e-7):

    ||result - sum_r acc_r||_2 <= sqrt(2) * (2**-(m+1) + 2**-20) * sum_r ||acc_r||_2

for 16-bit codes with the default block of 256 (flushing below 2**-30 of a block's
maximum adds less than 2**-25 * ||acc_r|| and is inside the 2**-20 term). With
error feedback that error is not lost: it is in the residual.

theta schedule: ``"constant"`` (theta every step) or ``"linear"``: theta at step s is
theta + (theta_final - theta) * min(s, decay_steps) / decay_steps, i.e. from theta to
theta_final over ``decay_steps`` steps, then theta_final (the paper lowers theta over
training for convergence).
"""
import math
import sys
from typing import Any, Optional

import numpy as np

from horovod_sparse.checks import check_int
from horovod_sparse.exchange import SparseAllreduce, mask_in_sorted
from horovod_sparse.lowrank.accumulate import accumulate
from horovod_sparse.ops.pieces import as_piece, is_pieces
from horovod_sparse.memory import ErrorFeedback
from horovod_sparse.ops import host, namespace, views
from horovod_sparse.pipeline import Pipeline, engine_state, load_engine_state, saved_array
from horovod_sparse.quantize.rangefloat import SPLITS, RangeFloatCodec

from .selection import TopCoefficients
from .spectrum import ChunkedSpectrum, coefficient_positions, coefficient_values

EXCHANGES = ("allgather", "oktopk")
SCHEDULES = ("constant", "linear")


class FFTStepInfo:
    """What one :meth:`FFTSparsifier.step` did on this rank (arrays in the buffer's
    library and device).

    step : the step's number (0-based).
    kept : float32 length n, this rank's contribution in the time domain as the
        receivers decode it (irfft of the decoded kept spectrum; for "oktopk" only
        the globally selected part). Computed on first access by the code that
        computed the residual (the same bits).
    kept_coefficients : number of complex coefficients this rank selected and sent.
    theta : the fraction of coefficients dropped at this step.
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    indices : sorted int64 spectral positions sent (re at 2j, im at 2j + 1).
    sent_values : float32 values at ``indices`` as decoded from this rank's codes.
    cleared : sorted int64 positions consumed (removed from the residual): ``indices``
        for "allgather", ``indices`` ∩ global selection for "oktopk".
    """

    def __init__(self, step, kept_coefficients, theta, traffic, indices, sent_values, cleared, make_kept):
        self.step, self.kept_coefficients, self.theta, self.traffic = step, kept_coefficients, theta, traffic
        self.indices, self.sent_values, self.cleared = indices, sent_values, cleared
        self._make_kept, self._kept = make_kept, None

    @property
    def kept(self) -> Any:
        if self._kept is None:
            self._kept = self._make_kept()
        return self._kept


def check_theta(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1) (fraction of coefficients dropped), "
                         f"got {value!r}")
    return float(value)


class FFTSparsifier(Pipeline):
    """State of one FFT-compressed gradient buffer of length ``n`` on this rank (a
    :class:`~horovod_sparse.pipeline.Pipeline`).

    Parameters
    ----------
    n : int >= 0, buffer length (elements).
    comm : mpi4py communicator of the ranks exchanging this buffer (duplicated by the
        engine: the constructor is collective).
    theta : fraction of the spectrum's complex coefficients dropped each step, [0, 1).
    bits : bits per value of the range-based float codes, one of 4, 8, 12, 16.
    chunk_size : elements per transformed chunk, >= 2 (the last chunk may be shorter).
    exchange : "allgather" (every rank's kept coefficients to everyone) or "oktopk"
        (Ok-Topk: k = the kept re/im entries, a global selection of the summed spectrum).
    theta_schedule : "constant" or "linear" (see the module docstring).
    theta_final : the theta reached after ``decay_steps`` ("linear"; default theta).
    decay_steps : int >= 0, steps of the linear decay (0 makes the schedule constant
        at theta).
    error_feedback : keep what was not consumed in a residual (default True).
    block_size : values sharing one exponent window in the codes (default 256).
    exchange_params : extra keyword parameters of the engine (e.g. oktopk's tau).

    Attributes: ``residual`` (float32 length n, in the buffer's library once a step ran;
    zeros without error feedback), ``last`` (:class:`FFTStepInfo`), ``traffic``,
    ``step_count``, ``numpy_on_cpu`` (True: CPU tensors run numpy's kernels on zero-copy
    views, the same bits as numpy input; False runs torch's, as on a GPU).
    """

    def __init__(self, n, comm, theta=0.9, bits=8, chunk_size=1024, exchange="allgather",
                 theta_schedule="constant", theta_final=None, decay_steps=0, error_feedback=True,
                 block_size=256, exchange_params=None):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        self.theta = check_theta("theta", theta)
        if isinstance(bits, bool) or bits not in SPLITS:
            raise ValueError(f"bits must be one of {sorted(SPLITS)}, got {bits!r}")
        self.chunk_size = check_int("chunk_size", chunk_size, 2, 2**31 - 1)
        if exchange not in EXCHANGES:
            raise ValueError(f"exchange must be one of {list(EXCHANGES)}, got {exchange!r}")
        if theta_schedule not in SCHEDULES:
            raise ValueError(f"theta_schedule must be one of {list(SCHEDULES)}, got {theta_schedule!r}")
        self.theta_final = self.theta if theta_final is None else check_theta("theta_final", theta_final)
        self.decay_steps = check_int("decay_steps", decay_steps, 0, 2**31 - 1)
        if not isinstance(error_feedback, (bool, np.bool_)):
            raise ValueError(f"error_feedback must be True or False, got {error_feedback!r}")
        self.n, self.bits, self.exchange = int(n), int(bits), exchange
        self.theta_schedule, self.error_feedback = theta_schedule, bool(error_feedback)
        self.codec = RangeFloatCodec(self.bits, block_size=block_size)
        self.spectrum = ChunkedSpectrum(self.n, self.chunk_size)
        k = max(1, 2 * self.kept_for(0)) if exchange == "oktopk" else None
        self.engine = SparseAllreduce(self.spectrum.size, exchange, k=k, comm=comm, average=False,
                                      value_codec=self.codec, **(exchange_params or {}))
        self._exchanges = (self.engine,)
        self.rank = self.engine.rank
        self.memory = ErrorFeedback(self.n, self.error_feedback)
        self.selection = TopCoefficients()
        self.last: Optional[FFTStepInfo] = None

    # -------------------------------------------------------------- schedule
    def theta_at(self, step):
        """Fraction of coefficients dropped at ``step`` (0-based)."""
        if self.theta_schedule == "constant" or self.decay_steps == 0:
            return self.theta
        progress = min(int(step), self.decay_steps) / self.decay_steps
        return self.theta + (self.theta_final - self.theta) * progress

    def kept_for(self, step):
        """Complex coefficients kept at ``step``: C - floor(theta * C) (>= 1 when C >= 1)."""
        total = self.spectrum.n_coefficients
        return total - min(total - 1, math.floor(self.theta_at(step) * total)) if total else 0

    @property
    def residual(self):
        return self.memory.residual

    # ------------------------------------------------------------------ step
    def step(self, grad, tag=0, finite=True):
        """Exchange this step's gradient; return the sum over ranks of their contributions.

        grad : 1-D float buffer of length n (numpy, a torch tensor on any device, or an
            eager TensorFlow tensor; cast to float32); or a list of 1-D float pieces that are
            that buffer back to back (a step's gradients, flattened), read where they are (the
            same bits as their concatenation cast to float32). Never modified. A wrong shape
            or total length raises ValueError on this rank alone (a programming error: the
            frontends flatten the same layout everywhere).
        tag : int every rank passes identically (a CRC of the layout); a mismatch
            raises ExchangeError on every rank.
        finite : False when another gradient of this rank's step overflowed (the step is
            skipped on every rank, as for an overflow here).

        Returns a new float32 buffer of length n in grad's library and device, bitwise
        identical on every rank. If the exchange raises, the residual and step count
        are left as they were; so they are when any rank's acc holds an inf or a NaN
        (NonFiniteGradientError on every rank).
        """
        acc, acc_finite = self._accumulate(_float32(grad, self.n))                  # step 1
        theta, kept_count = self.theta_at(self.step_count), self.kept_for(self.step_count)
        if self.exchange == "oktopk":
            self.engine.set_k(max(1, 2 * kept_count))
        if not (finite and acc_finite()):  # nothing worth transforming: every rank skips
            self.engine.allreduce(np.empty(0, np.int64), np.empty(0, np.float32), tag=tag, finite=False)
            raise AssertionError("unreachable: the exchange went on with a non-finite gradient")
        ws = self._workspace_for(acc)
        kernel = self._kernel
        spectrum = self.spectrum.forward(kernel(acc), kernel(ws.spectrum))           # step 2

        keys = self.spectrum.energy_keys(spectrum, ws.keys, ws.squares, ws.energy_block)
        coefficients = self.selection.select(keys, kept_count, ws.mask)               # step 3
        positions = coefficient_positions(coefficients, namespace.empty(2 * kept_count, "int64", keys))
        values = coefficient_values(spectrum, coefficients)
        positions, values = views.as_like(positions, acc), views.as_like(values, acc)
        sent, sent_values = host.to_host_packed(positions, values)
        result = self.engine.allreduce(sent, sent_values, tag=tag)                  # step 4

        # back in one transfer: the values as sent (decoded; aligned with positions, sorted),
        # what the exchange consumed of them (oktopk), and the summed pairs
        back = [result.sent_values, result.indices, result.values]
        if self.exchange == "oktopk":
            consumed = mask_in_sorted(sent, np.asarray(result.selected, dtype=np.int64))
            back += [sent[consumed], result.sent_values[consumed]]
        back = host.from_host_packed(back, acc)
        decoded, summed_indices, summed_values = back[:3]
        cleared, kept_values = (positions, decoded) if self.exchange != "oktopk" else back[3:]
        # TensorFlow: each inverse makes its own tensor, no buffer to write into
        out = None if namespace.is_tensorflow(acc) else namespace.new_empty(self.n, "float32", acc)
        if self.error_feedback:                                                      # step 6
            out = self._inverse_sparse(cleared, kept_values, out, ws)
            self.memory.commit_minus(acc, out)
        out = self._inverse_sparse(summed_indices, summed_values, out, ws)          # step 5
        self.last = FFTStepInfo(self.step_count, kept_count, theta, result.traffic, positions, decoded,
                                cleared, lambda: self._kept(cleared, kept_values, ws))
        self.step_count += 1
        return out

    takes_pieces = True  # step 1 reads a step's gradients where they are (no fused copy)

    def _new_workspace(self, like):
        return _Workspace(self.spectrum, like, self.numpy_on_cpu)

    def _accumulate(self, grad):
        """Step 1: ``(acc, finite)``, ``finite()`` telling whether acc is all finite
        (:func:`horovod_sparse.lowrank.accumulate.accumulate`, shared with PowerSGD: with the
        compiled kernels, numpy or CPU tensors run through numpy, acc is written into the
        residual's spare and checked in the same pass, piece by piece where grad is pieces;
        else the memory accumulates and the check is a pass of its own). The state is
        untouched either way."""
        return accumulate(self.memory, grad, self.numpy_on_cpu)

    def _inverse_sparse(self, positions, values, out, ws):
        """out = the inverse transform of the spectrum that is ``values`` at ``positions``
        and zero elsewhere (through the workspace's spectrum buffer); returns ``out``
        (TensorFlow: a new tensor, ``out`` is None)."""
        spectrum = self.spectrum.scatter(self._kernel(positions), self._kernel(values),
                                         self._kernel(ws.spectrum))
        inverse = self.spectrum.inverse(spectrum, self._kernel(out))
        return inverse if namespace.is_tensorflow(inverse) else out

    def _kept(self, positions, values, ws):
        """irfft of this rank's decoded kept spectrum (see :class:`FFTStepInfo`)."""
        kept = None if namespace.is_tensorflow(positions) else namespace.new_empty(self.n, "float32",
                                                                                   ws.spectrum)
        return self._inverse_sparse(positions, values, kept, ws)

    # ----------------------------------------------------------- checkpoints
    def _own_state(self):
        """The residual and the engine's state (prefixed)."""
        return {"residual": self.memory.state_dict()["residual"], **engine_state("engine_", self.engine)}

    def _load_own_state(self, state):
        residual = saved_array(state, "residual", (self.n,))
        load_engine_state(self.engine, state, "engine_")
        self.memory.load_state_dict({"residual": residual})

    def __repr__(self):
        return (f"FFTSparsifier(n={self.n}, theta={self.theta}, bits={self.bits}, "
                f"chunk_size={self.chunk_size}, exchange={self.exchange!r}, step={self.step_count})")


class _Workspace:
    """The buffers of a pipeline, allocated once per library and device of the gradient:
    ``spectrum`` (float32, 2C, the buffer's library: forward spectrum, then the sparse
    spectra to invert); in the kernels' library ``keys`` (C), ``mask`` (C bools) and
    ``squares`` (energy scratch). None of them for TensorFlow (its kernels make new tensors)."""

    def __init__(self, spectrum, like, numpy_on_cpu):
        if namespace.is_tensorflow(like):
            self.spectrum = self.keys = self.mask = self.squares = None
            self.energy_block = max(spectrum.n_coefficients, 1)
            return
        self.spectrum = namespace.empty(spectrum.size, "float32", like)
        work = views.kernel_view(self.spectrum, numpy_on_cpu)
        on_cpu = namespace.host_shortcut_allowed(work)
        count = spectrum.n_coefficients
        self.energy_block = 1 << 16 if on_cpu else max(count, 1)
        self.keys = namespace.empty(count, "float32", work)
        self.mask = namespace.empty(count, "bool", work)
        self.squares = namespace.empty(2 * min(count, self.energy_block), "float32", work)


def _float32(grad, n):
    """``grad`` as a contiguous 1-D float32 buffer of length n (numpy, torch or TensorFlow); or,
    for a list of pieces, the checked pieces (:func:`~horovod_sparse.ops.pieces.as_piece`,
    n elements in all; TensorFlow's fused into one float32 tensor, no pieces: an empty
    buffer); else ValueError."""
    if is_pieces(grad):
        pieces = [as_piece(piece) for piece in grad]
        bad = next((piece for piece, checked in zip(grad, pieces) if checked is None), None)
        if bad is not None:
            raise ValueError(f"grad must be a 1-D float array of length n={n}, got a piece of shape "
                             f"{tuple(getattr(bad, 'shape', ()))} dtype {getattr(bad, 'dtype', type(bad).__name__)}")
        total = sum(int(piece.shape[0]) for piece in pieces)
        if total != n:
            raise ValueError(f"grad must be a 1-D float array of length n={n}, "
                             f"got pieces of {total} elements in all")
        if not pieces:
            return np.empty(0, np.float32)
        if any(namespace.is_tensorflow(piece) for piece in pieces):
            return namespace.concat_float32(pieces)
        return pieces
    if namespace.is_tensorflow(grad):
        g = grad
        if g.shape.rank == 1 and g.shape[0] == n and g.dtype.is_floating:
            return sys.modules["tensorflow"].cast(g, "float32")
    elif namespace.is_torch(grad):
        g = grad.detach()
        if g.dim() == 1 and g.numel() == n and g.is_floating_point():
            return g.to(namespace.dtype_of(g, "float32")).contiguous()
    else:
        g = np.asarray(grad)
        if g.ndim == 1 and g.size == n and g.dtype.kind == "f":
            return np.ascontiguousarray(g, dtype=np.float32)
    raise ValueError(f"grad must be a 1-D float array of length n={n}, "
                     f"got shape {tuple(g.shape)} dtype {g.dtype}")
