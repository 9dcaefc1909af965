"""The FFT pipeline: error feedback -> chunked rfft -> drop low-energy coefficients ->
range-based float codes -> sparse allreduce of the spectrum -> inverse rfft -> residual.

FFT-based gradient sparsification (Wang et al., HPDC'20). Per step on every rank:

1. acc = grad + residual (float32; acc = grad without error feedback);
2. S = the chunked real spectrum of acc (:class:`.spectrum.ChunkedSpectrum`: rfft,
   norm="ortho", of ``chunk_size``-element chunks, the last one shorter), a float32
   vector of 2 * C values (C complex coefficients, re and im interleaved);
3. keep the C - floor(theta * C) coefficients of largest energy (|X|**2 weighted by
   Parseval, i.e. the coefficient's share of the signal's energy; ties to the lower
   position) and drop the others: theta is the FRACTION OF COEFFICIENTS DROPPED,
   in [0, 1), so at least one coefficient is kept; both the re and im of a kept
   coefficient are sent;
4. exchange the kept (position, value) pairs through
   :class:`~horovod_sparse.exchange.SparseAllreduce` ("allgather", or "oktopk" with
   k = 2 * kept entries, i.e. the kept re/im count), values carried as
   :class:`~horovod_sparse.quantize.rangefloat.RangeFloatCodec` codes, summing over ranks;
5. result = the inverse chunked rfft of the summed spectrum: float32, length n,
   bitwise identical on every rank (same bytes in, same arithmetic);
6. residual = acc - irfft(K), K = this rank's kept spectrum AS DECODED from its codes,
   restricted for "oktopk" to what the global selection kept (local ∩ global), so the
   quantization error and whatever was dropped stay in the residual.

The FFT is linear, so (up to float rounding) the result is the sum over ranks of
irfft(K_r): the step's ``last.kept``.

Conservation: ``last.kept + new residual == acc`` up to one float32 rounding of the
subtraction: elementwise ``|kept + residual - acc| <= 2**-23 * (|acc| + |kept|)``.

Error of a step against the exact sum (theta = 0, all coefficients kept, "allgather"):
the transform is orthonormal, so the time-domain L2 error of rank r's contribution is at
most sqrt(2) times the L2 error of its spectrum codes, itself at most
2**-(m+1) * ||S_r|| + the flushed values (2**-(m+1) is the codec's relative bound, see
:mod:`horovod_sparse.quantize.rangefloat`), plus float32 rounding of the transforms:

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
from dataclasses import dataclass
from typing import Optional

import numpy as np

from horovod_sparse.exchange import ALGORITHMS, SparseAllreduce, Traffic, mask_in_sorted
from horovod_sparse.quantize.rangefloat import SPLITS, RangeFloatCodec
from horovod_sparse.checks import check_int
from horovod_sparse.closing import ClosesOnExit

from .spectrum import VALUE_DTYPE, ChunkedSpectrum, coefficient_positions, top_coefficients

EXCHANGES = ("allgather", "oktopk")
SCHEDULES = ("constant", "linear")
_STATE_FORMAT = 1


@dataclass(frozen=True)
class FFTStepInfo:
    """What one :meth:`FFTSparsifier.step` did on this rank.

    step : the step's number (0-based).
    kept : float32 length n, this rank's contribution in the time domain as the
        receivers decode it (irfft of the decoded kept spectrum; for "oktopk" only
        the globally selected part).
    kept_coefficients : number of complex coefficients this rank selected and sent.
    theta : the fraction of coefficients dropped at this step.
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    indices : sorted int64 spectral positions sent (re at 2j, im at 2j + 1).
    sent_values : float32 values at ``indices`` as decoded from this rank's codes.
    cleared : sorted int64 positions consumed (removed from the residual): ``indices``
        for "allgather", ``indices`` ∩ global selection for "oktopk".
    """

    step: int
    kept: np.ndarray
    kept_coefficients: int
    theta: float
    traffic: Traffic
    indices: np.ndarray
    sent_values: np.ndarray
    cleared: np.ndarray


def check_theta(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value) or not 0 <= value < 1:
        raise ValueError(f"{name} must be a number in [0, 1) (fraction of coefficients dropped), "
                         f"got {value!r}")
    return float(value)


class FFTSparsifier(ClosesOnExit):
    """State of one FFT-compressed gradient buffer of length ``n`` on this rank.

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
        self.rank = self.engine.rank
        self.residual = np.zeros(self.n, VALUE_DTYPE)
        self.step_count = 0
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
    def traffic(self):
        """Cumulative Traffic of this buffer's exchanges on this rank."""
        return self.engine.traffic

    # ------------------------------------------------------------------ step
    def step(self, grad, tag=0):
        """Exchange this step's gradient; return the sum over ranks of their contributions.

        grad : 1-D float array of length n (cast to float32).
        tag : int every rank passes identically (a CRC of the layout); a mismatch
            raises ExchangeError on every rank.

        Returns a new float32 array of length n, bitwise identical on every rank. If the
        exchange raises, the residual and step count are left as they were.
        """
        grad = np.asarray(grad)
        if grad.ndim != 1 or grad.size != self.n or grad.dtype.kind != "f":
            raise ValueError(f"grad must be a 1-D float array of length n={self.n}, "
                             f"got shape {grad.shape} dtype {grad.dtype}")
        grad = grad.astype(VALUE_DTYPE, copy=False)
        acc = np.add(grad, self.residual, dtype=VALUE_DTYPE) if self.error_feedback else grad.copy()
        theta, kept_count = self.theta_at(self.step_count), self.kept_for(self.step_count)
        spectrum = self.spectrum.forward(acc)
        coefficients = top_coefficients(self.spectrum.energies(spectrum), kept_count)
        positions = coefficient_positions(coefficients)
        if self.exchange == "oktopk":
            self.engine.set_k(max(1, positions.size))
        result = self.engine.allreduce(positions, spectrum[positions], tag=tag)

        decoded = result.sent_values  # aligned with positions (sorted)
        if self.exchange == "oktopk":
            consumed = mask_in_sorted(positions, np.asarray(result.selected, dtype=np.int64))
        else:
            consumed = np.ones(positions.size, bool)
        cleared = positions[consumed]
        kept_spectrum = np.zeros(self.spectrum.size, VALUE_DTYPE)
        kept_spectrum[cleared] = decoded[consumed]
        kept = self.spectrum.inverse(kept_spectrum)
        if self.error_feedback:
            self.residual = np.subtract(acc, kept, dtype=VALUE_DTYPE)
        out = self.spectrum.inverse(result.dense())
        self.last = FFTStepInfo(self.step_count, kept, int(coefficients.size), theta, result.traffic,
                                positions, decoded, cleared)
        self.step_count += 1
        return out

    # ----------------------------------------------------------- checkpoints
    def state_dict(self):
        """numpy arrays and ints only: residual, step counter, engine state."""
        d = {"format": _STATE_FORMAT, "n": self.n, "step": self.step_count,
             "residual": self.residual.copy()}
        engine = dict(self.engine.state_dict())
        engine["algorithm"] = ALGORITHMS.index(engine["algorithm"])
        d.update({"engine_" + key: v for key, v in engine.items()})
        return d

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n and world size; each rank its own)."""
        if int(d.get("format", -1)) != _STATE_FORMAT or int(d.get("n", -1)) != self.n:
            raise ValueError(f"state_dict is for format {d.get('format')!r} and n={d.get('n')!r}; "
                             f"this pipeline has format {_STATE_FORMAT} and n={self.n}")
        residual = np.asarray(d["residual"])
        if residual.shape != (self.n,):
            raise ValueError(f"state_dict residual must have shape ({self.n},), got {residual.shape}")
        engine = {key[len("engine_"):]: v for key, v in d.items() if key.startswith("engine_")}
        code = int(engine.get("algorithm", -1))
        engine["algorithm"] = ALGORITHMS[code] if 0 <= code < len(ALGORITHMS) else code
        engine = {key: (int(v) if key in ("format", "n", "world_size", "calls") else v)
                  for key, v in engine.items()}
        self.engine.load_state_dict(engine)
        self.residual = residual.astype(VALUE_DTYPE, copy=True)
        self.step_count = int(d["step"])
        self.last = None

    def close(self):
        """Free the engine's communicator (idempotent)."""
        self.engine.close()

    def __repr__(self):
        return (f"FFTSparsifier(n={self.n}, theta={self.theta}, bits={self.bits}, "
                f"chunk_size={self.chunk_size}, exchange={self.exchange!r}, step={self.step_count})")
