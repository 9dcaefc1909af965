"""The stateful per-buffer pipeline of the quantizers: memory -> compressed allreduce -> memory.

One :class:`QuantizedPipeline` holds what one gradient buffer of length ``n`` needs on
this rank from step to step: its memory (:mod:`horovod_sparse.memory`: the
error-feedback residual, or Signum's momentum), the exchange (a
:class:`~horovod_sparse.exchange.compressed.CompressedAllreduce` on a duplicated
communicator, with its server residual) and a step counter. It is a
:class:`~horovod_sparse.pipeline.Pipeline`, so the frontends drive it as the others.

A step, on the buffer's own library and device (numpy, or torch on CPU/CUDA):

1. ``acc = memory.accumulate(grad)``: grad + residual (error feedback), Signum's
   u = momentum * u + grad, or grad itself; one pass, into a reused buffer. ``grad`` may be
   a list of pieces (:attr:`~horovod_sparse.pipeline.Pipeline.takes_pieces`: a step's
   gradients, flattened, back to back), read where they are, each into its slice of that
   buffer (with the kernels: one fused accumulate + overflow check per piece), the same bits
   as their float32 concatenation; so the frontends skip the fused copy;
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
from typing import Any, Callable, Optional

import numpy as np

from horovod_sparse.checks import check_bool
from horovod_sparse.exchange.compressed import CompressedAllreduce
from horovod_sparse.exchange.seeds import derive_seed
from horovod_sparse.exchange.comm import Traffic
from horovod_sparse.memory import ErrorFeedback, Momentum
from horovod_sparse.ops import cpu, namespace, views
from horovod_sparse.ops.cpu import memory as memory_kernels
from horovod_sparse.ops.finite import all_finite
from horovod_sparse.ops.pieces import as_piece, float32_views
from horovod_sparse.pipeline import Pipeline, saved_array, with_prefix, without_prefix


@dataclass(frozen=True)
class QuantizeStepInfo:
    """What one :meth:`QuantizedPipeline.step` did on this rank.

    step : the step's number (0-based).
    kept : float32 length n, what this rank sent as the receivers decode it (its share
        of the result; new residual = sent - kept), with error feedback; else None.
        Valid until the next step. (Where the encode wrote the residual itself, the step
        did not write these floats: they are decoded from the step's codes when asked for.)
    traffic : :class:`~horovod_sparse.exchange.Traffic` of this step on this rank.
    """

    step: int
    own: Any
    traffic: Traffic
    decode_own: Optional[Callable[[], Any]] = None

    @property
    def kept(self):
        return self.decode_own() if self.own is None and self.decode_own is not None else self.own


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
        self._results = views.ReusedResult(self.n)  # where the exchange writes a CPU step's sum

    @property
    def residual(self):
        """The error-feedback residual (float32 n, the live buffer), or None."""
        return self.memory.residual if self.error_feedback else None

    @property
    def momentum_buffer(self):
        """Signum's momentum u (float32 n, the live buffer), or None."""
        return self.memory.momentum_buffer if self.momentum is not None else None

    takes_pieces = True  # step 1 reads a step's gradients where they are (no fused copy)
    fresh_result = True  # a result buffer nobody else holds (ReusedResult), or new tensors

    def step(self, grad, tag=0, finite=True):
        """Exchange this step's gradient; return the sum over ranks of what they sent, decoded.

        grad : 1-D float array of length n (cast to float32), numpy or a torch tensor on
            any device, or an eager TensorFlow tensor; this rank's gradient, only read. Or a
            list of 1-D float pieces that are that buffer back to back (a step's gradients,
            flattened), read where they are: the same bits as their concatenation cast to
            float32. A bad grad (wrong length, not float, not 1-D; pieces of another total
            length) is reported through the exchange's agreement: ExchangeError on every rank.
        tag : int every rank passes identically (a CRC of the layout).
        finite : False when another gradient of this rank's step overflowed (the step is
            skipped on every rank, as for an overflow here).

        Returns a new float32 array of length n in grad's library and device (the first
        piece's), bitwise identical on every rank. If the exchange raises, the pipeline's
        state is left as it was before the call; so it is when any rank's acc holds an inf
        or a NaN (NonFiniteGradientError on every rank).
        """
        if isinstance(grad, (list, tuple)):
            g = self._pieces(grad)
        else:
            g = self._float32(grad)
        if g is None:
            self.exchange.allreduce(_bad_stand_in(grad, self.n), seed=0, tag=tag)  # ExchangeError on every rank
            raise AssertionError("unreachable: the exchange accepted a bad gradient")
        views_found = self._fusable(g)
        if views_found is not None:
            result = self._fused_step(g, views_found, tag, finite)
        else:
            pieces = isinstance(g, list)
            acc = self.memory.accumulate_pieces(g) if pieces else self.memory.accumulate(g)   # 1.
            result = self.exchange.allreduce(acc, seed=derive_seed(self.seed, self.step_count), tag=tag,
                                             want_own=self.error_feedback, finite=finite and all_finite(acc),
                                             out=self._results.like(acc))  # 2.
            if self.momentum is not None:                                     # 3.
                self.memory.commit(acc)
            else:
                self.memory.commit_minus(acc, result.own)
        self.last = QuantizeStepInfo(self.step_count, result.own, result.traffic,
                                     self.exchange.decoded_own if self.error_feedback else None)
        self.step_count += 1
        return result.values

    def _pieces(self, grad):
        """The checked pieces (a list of contiguous 1-D float arrays, n elements in all), or one
        float32 buffer (TensorFlow pieces fused; no pieces at all for n = 0; a single piece
        without memory, read as the buffer), or None when a piece is bad or the total length
        is not n."""
        try:
            pieces = [as_piece(piece) for piece in grad]
            if any(piece is None for piece in pieces) or sum(int(p.shape[0]) for p in pieces) != self.n:
                return None
            if not pieces:
                return np.empty(0, np.float32)
            if len(pieces) == 1 and self.momentum is None and not self.error_feedback:
                return self._float32(pieces[0])  # no memory: acc is the gradient itself, no copy
            if any(namespace.is_tensorflow(piece) for piece in pieces):
                return namespace.concat_float32(pieces)
            return pieces
        except Exception:
            return None

    def _fusable(self, g):
        """numpy views of the gradient's pieces (one buffer: one piece) when this step runs the
        compiled kernels (:mod:`horovod_sparse.ops.cpu.quantize`): they are on, the codec has
        them and every piece is float32 numpy or a float32 CPU tensor; else None."""
        if not (cpu.enabled() and getattr(self.codec, "fused_cpu", False)):
            return None
        return float32_views(g if isinstance(g, list) else [g])

    def _fused_step(self, g, found, tag, finite):
        """Steps 1-3 with the kernels: acc and the overflow check in one pass into the memory's
        spare, piece by piece into its slices (a single buffer without memory is acc itself);
        the encode writes the next residual into that same spare (acc - own, in its pass);
        the commit is a swap, only once the exchange succeeded. The same bits as the numpy path."""
        state_name = ("momentum_buffer" if self.momentum is not None
                      else "residual" if self.error_feedback else None)
        first = g[0] if isinstance(g, list) else g
        if state_name is None and not isinstance(g, list):
            acc, ok = g, all_finite(found[0])
        else:
            state, acc = self.memory.buffers(state_name or "residual", first)
            state, out = views.numpy_view(state), views.numpy_view(acc)
            momentum, ok, offset = np.float32(self.momentum or 0), True, 0
            for view in found:
                part = slice(offset, offset + view.shape[0])
                if self.momentum is not None:
                    ok = memory_kernels.momentum_finite(view, state[part], momentum, out[part]) and ok
                elif self.error_feedback:
                    ok = memory_kernels.accumulate_finite(view, state[part], out[part]) and ok
                else:
                    ok = memory_kernels.copy_finite(view, out[part]) and ok
                offset = part.stop
        result = self.exchange.allreduce(acc, seed=derive_seed(self.seed, self.step_count), tag=tag,
                                         want_own=False, finite=finite and ok,   # the encode writes the residual
                                         residual=acc if self.error_feedback else None,
                                         out=self._results.like(acc))
        if state_name is not None:
            self.memory.commit_spare(state_name)
        return result

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


def _bad_stand_in(grad, n):
    """What the exchange is handed for a bad ``grad`` so that its agreement reports it: a bad
    buffer as it is; for pieces, a float32 stand-in of their total length (no memory: a
    broadcast zero) when every piece is 1-D float data, else a 2-D array (bad values)."""
    if not isinstance(grad, (list, tuple)):
        return grad
    try:
        pieces = [as_piece(piece) for piece in grad]
        total = sum(int(p.shape[0]) for p in pieces if p is not None)
        if all(piece is not None for piece in pieces) and total != n:
            return np.broadcast_to(np.float32(0), (total,))
    except Exception:
        pass
    return np.zeros((0, 0), np.float32)
