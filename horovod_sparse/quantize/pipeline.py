"""The stateful per-buffer pipeline of the quantizers: memory -> compressed allreduce -> memory.

One :class:`QuantizedPipeline` holds what one gradient buffer of length ``n`` needs on
this rank from step to step: the error-feedback residual (or Signum's momentum), the
exchange (a :class:`~horovod_sparse.exchange.compressed.CompressedAllreduce` on a
duplicated communicator, with its server residual) and a step counter. It has the
interface of :class:`~horovod_sparse.sparsify.Sparsifier`, so the frontends drive it
the same way.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np

from horovod_sparse.exchange.compressed import CompressedAllreduce
from horovod_sparse.exchange.traffic import Traffic
from horovod_sparse.checks import check_bool
from horovod_sparse.closing import ClosesOnExit

from .codec import VALUE_DTYPE, derive_seed

_STATE_FORMAT = 1


@dataclass(frozen=True)
class QuantizeStepInfo:
    """What one :meth:`QuantizedPipeline.step` did on this rank.

    step : the step's number (0-based).
    sent : float32 length n, the vector this rank encoded (gradient + residual, or
        Signum's momentum).
    kept : float32 length n, ``sent`` as the receivers decode it (this rank's share of
        the result). With error feedback, new residual = sent - kept.
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    """

    step: int
    sent: np.ndarray
    kept: np.ndarray
    traffic: Traffic


class QuantizedPipeline(ClosesOnExit):
    """State of one quantized gradient buffer of length ``n`` on this rank.

    Parameters
    ----------
    n : int >= 0
        Buffer length (elements).
    comm : mpi4py communicator; duplicated by the exchange (collective).
    codec : :class:`~horovod_sparse.quantize.ValueCodec`, the code on the wire.
    method : "alltoall" (default) or "allgather", see
        :mod:`horovod_sparse.exchange.compressed`.
    error_feedback : bool (default True)
        Send grad + residual and keep residual = sent - decoded (Seide et al.,
        Karimireddy et al.). Exclusive with ``momentum``.
    momentum : None (default) or Signum's momentum factor in [0, 1): u = momentum * u
        + grad, and u is sent (no residual).
    seed : int >= 0 (default 0), the base of the stochastic codes' seeds: step s uses
        ``derive_seed(seed, s)`` as the exchange's seed.
    server_error_feedback : None (default), True or False
        The exchange's owner-side residual (alltoall, "sum" codecs). None means: on
        when ``error_feedback`` is on, the method is alltoall and the codec sums.

    Conservation (error feedback): the new residual is fl(sent - kept) in float32, so
    kept + residual == sent up to that one rounding: |kept + residual - sent| <=
    2**-24 * |sent - kept| elementwise (exact wherever sent - kept is representable).

    Attributes: ``n``, ``step_count``, ``residual`` (float32 n or None), ``momentum_buffer``
    (float32 n or None), ``last`` (:class:`QuantizeStepInfo`, None before the first step),
    ``traffic`` (cumulative), ``exchange``.
    """

    def __init__(self, n, comm, codec, method="alltoall", error_feedback=True, momentum=None,
                 seed=0, server_error_feedback=None):
        error_feedback = check_bool("error_feedback", error_feedback)
        if momentum is not None:
            if isinstance(momentum, bool) or not isinstance(momentum, (int, float, np.floating)) \
                    or not np.isfinite(momentum) or not 0 <= momentum < 1:
                raise ValueError(f"momentum must be None or a number in [0, 1), got {momentum!r}")
            if error_feedback:
                raise ValueError("momentum and error_feedback are exclusive: pass error_feedback=False "
                                 "with momentum (Signum sends the momentum, no residual)")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2 ** 63:
            raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}")
        if server_error_feedback is None:
            server_error_feedback = (error_feedback and method == "alltoall"
                                     and getattr(codec, "aggregate", "sum") == "sum")
        self.exchange = CompressedAllreduce(n, codec, method=method, comm=comm,
                                            server_error_feedback=server_error_feedback)
        self.n, self.codec, self.method, self.seed = self.exchange.n, codec, method, int(seed)
        self.error_feedback = error_feedback
        self.momentum = None if momentum is None else float(momentum)
        self.residual = np.zeros(self.n, VALUE_DTYPE) if error_feedback else None
        self.momentum_buffer = np.zeros(self.n, VALUE_DTYPE) if momentum is not None else None
        self.rank = self.exchange.rank
        self.step_count = 0
        self.last: Optional[QuantizeStepInfo] = None

    @property
    def traffic(self):
        """Cumulative Traffic of this buffer's exchanges on this rank."""
        return self.exchange.traffic

    def step(self, grad, tag=0):
        """Exchange this step's gradient; return the sum over ranks of what they sent, decoded.

        grad : 1-D float array of length n (cast to float32), this rank's gradient. A
            bad grad (wrong length, not float, not 1-D) is reported through the
            exchange's agreement: ExchangeError on every rank.
        tag : int every rank passes identically (a CRC of the layout).

        Returns a new float32 array of length n, bitwise identical on every rank. If
        the exchange raises, the pipeline's state is left as it was before the call.
        """
        g = np.asarray(grad)
        if g.ndim != 1 or g.size != self.n or g.dtype.kind != "f":
            self.exchange.allreduce(g, seed=0, tag=tag)  # raises ExchangeError on every rank
            raise AssertionError("unreachable: the exchange accepted a bad gradient")
        g = g.astype(VALUE_DTYPE, copy=False)
        new_momentum = None
        if self.momentum_buffer is not None:
            new_momentum = VALUE_DTYPE(self.momentum) * self.momentum_buffer + g
            sent = new_momentum
        elif self.residual is not None:
            sent = g + self.residual
        else:
            sent = g.copy()
        result = self.exchange.allreduce(sent, seed=derive_seed(self.seed, self.step_count), tag=tag)
        if self.residual is not None:
            self.residual = sent - result.own
        if new_momentum is not None:
            self.momentum_buffer = new_momentum
        self.last = QuantizeStepInfo(self.step_count, sent, result.own, result.traffic)
        self.step_count += 1
        return result.values

    # ------------------------------------------------------------ checkpoints
    def state_dict(self):
        """numpy arrays and ints only: residual, momentum, step, exchange state (prefixed)."""
        empty = np.zeros(0, VALUE_DTYPE)
        d = {"format": _STATE_FORMAT, "n": self.n, "step": self.step_count,
             "residual": empty if self.residual is None else self.residual.copy(),
             "momentum_buffer": empty if self.momentum_buffer is None else self.momentum_buffer.copy()}
        d.update({"exchange_" + k: v for k, v in self.exchange.state_dict().items()})
        return d

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n, codec and world size; each rank its own)."""
        if int(d.get("format", -1)) != _STATE_FORMAT or int(d.get("n", -1)) != self.n:
            raise ValueError(f"state_dict is for format {d.get('format')!r} and n={d.get('n')!r}; "
                             f"this pipeline has format {_STATE_FORMAT} and n={self.n}")
        for key, mine in (("residual", self.residual), ("momentum_buffer", self.momentum_buffer)):
            if mine is not None and np.shape(d[key]) != mine.shape:
                raise ValueError(f"state_dict {key} has shape {np.shape(d[key])}, expected {mine.shape}")
        self.exchange.load_state_dict({k[len("exchange_"):]: v for k, v in d.items()
                                       if k.startswith("exchange_")})
        if self.residual is not None:
            self.residual = np.array(d["residual"], dtype=VALUE_DTYPE)
        if self.momentum_buffer is not None:
            self.momentum_buffer = np.array(d["momentum_buffer"], dtype=VALUE_DTYPE)
        self.step_count = int(d["step"])
        self.last = None

    def close(self):
        """Free the exchange's communicator (idempotent)."""
        self.exchange.close()

    def __repr__(self):
        return (f"QuantizedPipeline(n={self.n}, codec={self.codec!r}, method={self.method!r}, "
                f"error_feedback={self.error_feedback}, momentum={self.momentum}, step={self.step_count})")
