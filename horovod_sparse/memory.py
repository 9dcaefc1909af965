"""What a pipeline remembers between steps: error feedback, DGC's momentum correction, or
Signum's momentum (GRACE's *Memory*). Written once, used by every out-of-band pipeline.

Every memory follows the same two-phase protocol, so that a step whose exchange fails
(an :class:`~horovod_sparse.exchange.ExchangeError`) changes nothing:

1. ``acc = memory.accumulate(grad)``: the vector to compress this step, written into a
   spare buffer (one pass over the gradient, no allocation); the state is untouched;
2. after the exchange, ``memory.commit_cleared(acc, cleared)`` (sparsifiers: the values
   at ``cleared`` were sent and consumed) or ``memory.commit_minus(acc, consumed)``
   (quantizers, PowerSGD, FFT: the receivers got ``consumed``) makes what is left of
   ``acc`` the new state, in place, and the old state's buffer becomes the next spare.

Buffers live in the gradient's own library and device (numpy, or torch on CPU/CUDA):
they are bound to it at the first ``accumulate``. Before that, and in
``state_dict``/``load_state_dict``, the state is numpy.

Conservation (error feedback): ``acc[cleared]`` plus the new residual is ``acc`` exactly;
``consumed`` plus the new residual is ``acc`` up to one float32 rounding of the subtraction.

Example::

    memory = ErrorFeedback(n)
    acc = memory.accumulate(grad)        # grad + residual
    picked = select(acc)                 # ... exchange acc[picked] ...
    memory.commit_cleared(acc, picked)   # residual = acc with zeros where it was sent
"""
import sys

import numpy as np

from horovod_sparse.ops import tensors

VALUE_DTYPE = np.dtype(np.float32)


class _Buffers:
    """Named float32 state vectors of length ``n``, each with a spare twin for the next
    step, kept in one library/device (see the module docstring)."""

    def __init__(self, n, names):
        self.n = int(n)
        self.state = {name: np.zeros(self.n, VALUE_DTYPE) for name in names}
        self.spare = {name: None for name in names}

    def bind(self, like):
        """Move the state to ``like``'s library and device (a no-op once there)."""
        for name, value in self.state.items():
            if tensors.is_torch(like) != tensors.is_torch(value) or (
                    tensors.is_torch(like) and value.device != like.device):
                self.state[name] = _convert(value, like)
                self.spare[name] = None

    def spare_of(self, name):
        if self.spare[name] is None:
            self.spare[name] = tensors.empty(self.n, "float32", self.state[name])
        return self.spare[name]

    def swap(self, name, new_state):
        self.spare[name], self.state[name] = self.state[name], new_state

    def state_dict(self):
        return {name: _numpy_copy(value) for name, value in self.state.items()}

    def load_state_dict(self, d):
        state = {name: _checked(d, name, self.n) for name in self.state}
        for name, value in state.items():
            self.state[name] = value if not tensors.is_torch(self.state[name]) else _convert(value, self.state[name])
            self.spare[name] = None


class ErrorFeedback:
    """acc = grad + residual; residual = acc minus what was consumed.

    n : buffer length (elements).
    enabled : False turns error feedback off: acc = grad itself, the residual stays zero
        and whatever is not sent is dropped.
    """

    def __init__(self, n, enabled=True):
        self.enabled = bool(enabled)
        self._buffers = _Buffers(n, ["residual"])

    @property
    def residual(self):
        return self._buffers.state["residual"]

    def accumulate(self, grad):
        if not self.enabled:
            return grad
        self._buffers.bind(grad)
        acc = self._buffers.spare_of("residual")
        tensors.backend(grad).add(grad, self.residual, out=acc)
        return acc

    def accumulate_pieces(self, pieces):
        """:meth:`accumulate` of the back-to-back concatenation of ``pieces`` (1-D float
        arrays, n elements in all, e.g. a step's gradients), read where they are: one pass
        instead of fusing them first. Without error feedback acc is the pieces fused."""
        self._buffers.bind(pieces[0])
        acc = self._buffers.spare_of("residual")
        lib = tensors.backend(acc)
        for piece, part in _slices(pieces):
            if self.enabled:
                lib.add(_float32(piece), self.residual[part], out=acc[part])
            else:
                _copy_into(acc[part], piece)
        return acc

    def commit_cleared(self, acc, cleared):
        if self.enabled:
            _zero_at(acc, cleared)
            self._buffers.swap("residual", acc)

    def commit_minus(self, acc, consumed):
        if self.enabled:
            tensors.backend(acc).subtract(acc, consumed, out=acc)
            self._buffers.swap("residual", acc)

    def state_dict(self):
        return self._buffers.state_dict()

    def load_state_dict(self, d):
        self._buffers.load_state_dict(d)


class MomentumCorrection:
    """DGC's momentum correction and momentum factor masking (Lin et al., ICLR 2018).

    u = momentum * u + grad  (the velocity, ``velocity``)
    v = v + u                (the accumulated velocity, ``residual``; acc = v)

    After the exchange both u and v are cleared at the consumed indices, so a
    coordinate's stale momentum does not keep pushing after it was applied. The
    momentum lives here: train with plain SGD (momentum 0) on top of it.
    """

    enabled = True

    def __init__(self, n, momentum):
        self.momentum = float(momentum)
        self._buffers = _Buffers(n, ["residual", "velocity"])

    @property
    def residual(self):
        return self._buffers.state["residual"]

    @property
    def velocity(self):
        return self._buffers.state["velocity"]

    def accumulate(self, grad):
        self._buffers.bind(grad)
        lib = tensors.backend(grad)
        u = self._buffers.spare_of("velocity")
        lib.multiply(self.velocity, np.float32(self.momentum), out=u)
        lib.add(u, grad, out=u)
        acc = self._buffers.spare_of("residual")
        lib.add(self.residual, u, out=acc)
        return acc

    def accumulate_pieces(self, pieces):
        """:meth:`accumulate` of the back-to-back concatenation of ``pieces`` (see
        :meth:`ErrorFeedback.accumulate_pieces`), slice by slice: the same float32 operations."""
        self._buffers.bind(pieces[0])
        u = self._buffers.spare_of("velocity")
        acc = self._buffers.spare_of("residual")
        lib = tensors.backend(acc)
        for piece, part in _slices(pieces):
            lib.multiply(self.velocity[part], np.float32(self.momentum), out=u[part])
            lib.add(u[part], _float32(piece), out=u[part])
            lib.add(self.residual[part], u[part], out=acc[part])
        return acc

    def commit_cleared(self, acc, cleared):
        u = self._buffers.spare["velocity"]
        _zero_at(u, cleared)
        _zero_at(acc, cleared)
        self._buffers.swap("velocity", u)
        self._buffers.swap("residual", acc)

    def state_dict(self):
        return self._buffers.state_dict()

    def load_state_dict(self, d):
        self._buffers.load_state_dict(d)


class Momentum:
    """Signum's momentum: u = momentum * u + grad is what is sent; nothing is subtracted.

    ``commit()`` keeps the new u (call it only once the exchange succeeded).
    """

    def __init__(self, n, momentum):
        self.momentum = float(momentum)
        self._buffers = _Buffers(n, ["momentum_buffer"])

    @property
    def momentum_buffer(self):
        return self._buffers.state["momentum_buffer"]

    def accumulate(self, grad):
        self._buffers.bind(grad)
        lib = tensors.backend(grad)
        u = self._buffers.spare_of("momentum_buffer")
        lib.multiply(self.momentum_buffer, np.float32(self.momentum), out=u)
        lib.add(u, grad, out=u)
        return u

    def commit(self, u):
        self._buffers.swap("momentum_buffer", u)

    def state_dict(self):
        return self._buffers.state_dict()

    def load_state_dict(self, d):
        self._buffers.load_state_dict(d)


def _zero_at(x, indices):
    """``x[indices] = 0`` in place (torch's index_fill_ is ~2x faster than the indexed store)."""
    if tensors.is_torch(x):
        x.index_fill_(0, indices, 0)
    else:
        x[indices] = 0


def _slices(pieces):
    """(piece, the slice of the buffer it covers), for back-to-back 1-D pieces."""
    offset = 0
    for piece in pieces:
        yield piece, slice(offset, offset + int(piece.shape[0]))
        offset += int(piece.shape[0])


def _float32(piece):
    """The piece as a float32 add must see it: float16/bfloat16 promote exactly, so they are
    used as they are; float64 is rounded to float32 first, as a fused float32 buffer would be."""
    if tensors.is_torch(piece):
        return piece.float() if piece.dtype == sys.modules["torch"].float64 else piece
    return piece.astype(VALUE_DTYPE) if piece.dtype == np.float64 else piece


def _copy_into(target, piece):
    if tensors.is_torch(target):
        target.copy_(piece)
    else:
        target[...] = piece


def _convert(value, like):
    """``value`` (numpy or torch) as float32 in ``like``'s library and device; a one-time
    move of state, not per-step traffic, so it is not counted as host traffic."""
    if tensors.is_torch(like):
        import torch
        t = value if tensors.is_torch(value) else torch.from_numpy(np.ascontiguousarray(value))
        return t.to(device=like.device, dtype=torch.float32).contiguous()
    return _numpy_copy(value)


def _numpy_copy(value):
    if tensors.is_torch(value):
        return value.detach().cpu().numpy().astype(VALUE_DTYPE, copy=True)
    return np.array(value, dtype=VALUE_DTYPE, copy=True)


def _checked(d, key, n):
    array = np.array(d[key], dtype=VALUE_DTYPE).reshape(-1)
    if array.size != n:
        raise ValueError(f"state_dict {key} has {array.size} elements, this buffer has {n}")
    return array
