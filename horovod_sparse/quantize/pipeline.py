"""The stateful per-buffer pipeline of the quantizers: memory -> compressed allreduce -> memory.

One :class:`QuantizedPipeline` holds what one gradient buffer of length ``n`` needs on
this rank from step to step: its memory (:mod:`horovod_sparse.memory`: the
error-feedback residual, or Signum's momentum), the exchange (a
:class:`~horovod_sparse.exchange.compressed.CompressedAllreduce` on a duplicated
communicator, with its server residual) and a step counter. It is a
:class:`~horovod_sparse.pipeline.Pipeline`, so the frontends drive it as the others.

A step, on the buffer's own library and device (numpy, or torch on CPU/CUDA):

1. ``acc = memory.accumulate(grad)``: grad + residual (error feedback), Signum's
   u = momentum * u + grad, or grad itself; one pass, into a reused buffer;
2. the compressed allreduce of ``acc`` with seed ``derive_seed(seed, step)``: encode on
   the device (writing what the receivers will decode, ``own``), codes to the host and
   over MPI, decode on the device;
3. only once the exchange succeeded: ``memory.commit_minus(acc, own)`` (residual =
   acc - own, in place) or ``memory.commit(u)``. A failed step changes nothing.

On eager TensorFlow tensors (the TensorFlow frontend's host call with ``on_device``, when the
compressor's ``tensorflow_ops`` is set) the same three steps run as TensorFlow ops on the
gradient's device: the memory, the codec and the exchange have TensorFlow spellings that
return new tensors, and only the codes cross to numpy for MPI. The bits are the numpy path's.
"""
import sys
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from horovod_sparse.checks import check_bool
from horovod_sparse.exchange.compressed import CompressedAllreduce
from horovod_sparse.exchange.seeds import derive_seed
from horovod_sparse.exchange.comm import Traffic
from horovod_sparse.memory import ErrorFeedback, Momentum
from horovod_sparse.ops import namespace
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.pipeline import Pipeline, saved_array, with_prefix, without_prefix


@dataclass(frozen=True)
class QuantizeStepInfo:
    """What one :meth:`QuantizedPipeline.step` did on this rank.

    step : the step's number (0-based).
    kept : float32 length n, what this rank sent as the receivers decode it (its share
        of the result; new residual = sent - kept), with error feedback; else None.
        A buffer of the exchange: valid until the next step.
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    """

    step: int
    kept: Any
    traffic: Traffic


class QuantizedPipeline(Pipeline):
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

    Attributes: ``n``, ``step_count``, ``residual`` (float32 n or None: the live buffer,
    reused two steps later), ``momentum_buffer`` (likewise), ``memory``, ``last``
    (:class:`QuantizeStepInfo`, None before the first step), ``traffic`` (cumulative),
    ``exchange``.
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
        self.memory = (Momentum(self.n, self.momentum) if momentum is not None
                       else ErrorFeedback(self.n, enabled=error_feedback))
        self._exchanges = (self.exchange,)
        self.rank = self.exchange.rank
        self.last: Optional[QuantizeStepInfo] = None

    @property
    def residual(self):
        """The error-feedback residual (float32 n, the live buffer), or None."""
        return self.memory.residual if self.error_feedback else None

    @property
    def momentum_buffer(self):
        """Signum's momentum u (float32 n, the live buffer), or None."""
        return self.memory.momentum_buffer if self.momentum is not None else None

    def step(self, grad, tag=0, finite=True):
        """Exchange this step's gradient; return the sum over ranks of what they sent, decoded.

        grad : 1-D float array of length n (cast to float32), numpy or a torch tensor on
            any device, or an eager TensorFlow tensor; this rank's gradient, only read. A bad grad (wrong length, not
            float, not 1-D) is reported through the exchange's agreement: ExchangeError
            on every rank.
        tag : int every rank passes identically (a CRC of the layout).
        finite : False when another gradient of this rank's step overflowed (the step is
            skipped on every rank, as for an overflow here).

        Returns a new float32 array of length n in grad's library and device, bitwise
        identical on every rank. If the exchange raises, the pipeline's state is left as
        it was before the call; so it is when any rank's acc holds an inf or a NaN
        (NonFiniteGradientError on every rank).
        """
        g = self._float32(grad)
        if g is None:
            self.exchange.allreduce(grad, seed=0, tag=tag)  # raises ExchangeError on every rank
            raise AssertionError("unreachable: the exchange accepted a bad gradient")
        acc = self.memory.accumulate(g)                                       # 1.
        result = self.exchange.allreduce(acc, seed=derive_seed(self.seed, self.step_count), tag=tag,
                                         want_own=self.error_feedback, finite=finite and all_finite(acc))  # 2.
        if self.momentum is not None:                                         # 3.
            self.memory.commit(acc)
        else:
            self.memory.commit_minus(acc, result.own)
        self.last = QuantizeStepInfo(self.step_count, result.own, result.traffic)
        self.step_count += 1
        return result.values

    def _float32(self, grad):
        """``grad`` as a 1-D float32 array of length n (no copy when it is one), or None."""
        try:
            if namespace.is_tensorflow(grad):
                if len(grad.shape) != 1 or grad.shape[0] != self.n or not grad.dtype.is_floating:
                    return None
                return sys.modules["tensorflow"].cast(grad, "float32")
            g = grad.detach() if namespace.is_torch(grad) else np.asarray(grad)
            if g.ndim != 1 or g.shape[0] != self.n or not namespace.namespace(g).isdtype(g.dtype, "real floating"):
                return None
            if namespace.is_torch(g):
                return g.to(namespace.dtype_of(g, "float32")).contiguous()
            return np.ascontiguousarray(g, dtype=np.float32)
        except Exception:
            return None

    # ------------------------------------------------------------ checkpoints
    def _own_state(self):
        """The residual and the momentum (empty when unused), the exchange's state (prefixed)."""
        empty = np.zeros(0, np.float32)
        memory = self.memory.state_dict()
        d = {"residual": memory["residual"] if self.error_feedback else empty,
             "momentum_buffer": memory["momentum_buffer"] if self.momentum is not None else empty}
        d.update(with_prefix("exchange_", self.exchange.state_dict()))
        return d

    def _load_own_state(self, state):
        key = "momentum_buffer" if self.momentum is not None else "residual" if self.error_feedback else None
        saved = None if key is None else saved_array(state, key, (self.n,))
        self.exchange.load_state_dict(without_prefix(state, "exchange_"))
        if key is not None:
            self.memory.load_state_dict({key: saved})

    def __repr__(self):
        return (f"QuantizedPipeline(n={self.n}, codec={self.codec!r}, method={self.method!r}, "
                f"error_feedback={self.error_feedback}, momentum={self.momentum}, step={self.step_count})")
