"""What a pipeline remembers between steps: error feedback, DGC's momentum correction, or
Signum's momentum (GRACE's *Memory*). One interface, :class:`Memory`, for every out-of-band
pipeline.

Every memory follows the same two-phase protocol, so that a step whose exchange fails
(an :class:`~horovod_sparse.exchange.ExchangeError`) changes nothing:

1. ``acc = memory.accumulate(grad)``: the vector to compress this step, written into a
   spare buffer (one pass over the gradient, no allocation); the state is untouched;
2. only after the exchange succeeded, commit what was sent: ``memory.commit_cleared(acc,
   cleared)`` (sparsifiers: the values at ``cleared`` were sent whole) or
   ``memory.commit_minus(acc, consumed)`` (quantizers, PowerSGD, FFT: the receivers got
   ``consumed``, a lossy copy of ``acc``) makes what is left of ``acc`` the new state, in
   place, and the old state's buffer becomes the next spare. A failed exchange commits
   nothing.

Buffers are float32 and live in the gradient's own library and device (numpy, or torch
on CPU/CUDA, or TensorFlow on its device): they are bound to it at the first ``accumulate``.
Before that, and in ``state_dict``/``load_state_dict``, the state is numpy. TensorFlow
tensors are immutable: there each phase makes new tensors (same float32 operations, same
bits) instead of writing into the spare buffer.

Conservation (error feedback): ``acc[cleared]`` plus the new residual is ``acc`` exactly;
``consumed`` plus the new residual is ``acc`` up to one float32 rounding of the subtraction.

Random-k (:mod:`horovod_sparse.compressors.randomk`) does the same error feedback with the
same arithmetic, ``acc = grad + residual`` then :func:`~horovod_sparse.ops.kernels.zero_at`
where sent, but not through a :class:`Memory`: its residual is per-gradient slot state
(``slot.residual``, ``slot.step``, saved by the frontends' ``state_dict``) in the
gradient's wire dtype (float16 and float64 stay so; a memory is float32), a ``tf.Variable``
inside TensorFlow graphs, so each framework's :class:`~horovod_sparse.ops.base.ArrayOps`
stores it. Its exchange is Horovod's allreduce, between ``compress`` and ``decompress``, so
it keeps the same two phases across them: ``compress`` writes acc beside the residual, and
``decompress`` commits it once the reduced payload is finite (:mod:`horovod_sparse.slots`).

Example::

    memory = ErrorFeedback(n)
    acc = memory.accumulate(grad)        # grad + residual
    picked = select(acc)                 # ... exchange acc[picked] ...
    memory.commit_cleared(acc, picked)   # residual = acc with zeros where it was sent
"""
import sys

import numpy as np

from horovod_sparse.ops.kernels import copy_into, zero_at
from horovod_sparse.ops.namespace import backend, empty, host_shortcut_allowed, is_tensorflow, is_torch, library_of

VALUE_DTYPE = np.dtype(np.float32)


class Memory:
    """The interface of a pipeline's memory (the protocol is in the module docstring).

    n : buffer length (elements). The state is the float32 vectors named in
    ``state_names``, each of length ``n`` with a spare twin for the next step.
    """

    state_names = ()

    def __init__(self, n):
        self.n = int(n)
        self._state = {name: np.zeros(self.n, VALUE_DTYPE) for name in self.state_names}
        self._spare = {name: None for name in self.state_names}

    def accumulate(self, grad):
        """The vector to compress this step (a spare buffer); the state is untouched."""
        raise NotImplementedError

    def accumulate_pieces(self, pieces):
        """:meth:`accumulate` of the back-to-back concatenation of ``pieces`` (1-D float
        arrays, n elements in all, e.g. a step's gradients), read where they are: one pass
        instead of fusing them first."""
        raise NotImplementedError(f"{type(self).__name__} accumulates whole buffers only")

    def commit_cleared(self, acc, cleared, where=None):
        """The exchange succeeded and sent ``acc`` whole at the indices ``cleared`` (at those of
        them that the bool mask ``where`` marks, if given: :func:`~horovod_sparse.ops.kernels.zero_at`)."""
        raise NotImplementedError

    def commit_minus(self, acc, consumed):
        """The exchange succeeded and the receivers got ``consumed`` for ``acc``."""
        raise NotImplementedError(f"{type(self).__name__} commits sparse selections only")

    def state_dict(self):
        """The state vectors by name, as float32 numpy copies."""
        return {name: _numpy_copy(value) for name, value in self._state.items()}

    def load_state_dict(self, d):
        state = {name: _checked(d, name, self.n) for name in self._state}
        for name, value in state.items():
            bound = library_of(self._state[name])[0] != "numpy"
            self._state[name] = _convert(value, self._state[name]) if bound else value
            self._spare[name] = None

    # -- for the fused kernels (horovod_sparse.ops.cpu): the buffers themselves ----------
    def buffers(self, name, like):
        """``(state, spare)`` of the state vector ``name``, bound to ``like``'s library and
        device: a fused kernel reads the state and writes the next one into the spare (the
        state stays as it was until :meth:`commit_spare`)."""
        self._bind(like)
        return self._state[name], self._spare_of(name)

    def commit_spare(self, name):
        """The exchange succeeded and a fused kernel wrote the next state of ``name`` into its
        spare (:meth:`buffers`): the spare becomes the state, the old state the next spare."""
        self._swap(name, self._spare[name])

    # -- the buffers: state, and a spare twin to write the next state into --------------
    def _bind(self, like):
        """Move the state to ``like``'s library and device (a no-op once there)."""
        for name, value in self._state.items():
            if library_of(like) != library_of(value):
                self._state[name] = _convert(value, like)
                self._spare[name] = None

    def _spare_of(self, name):
        if self._spare[name] is None:
            self._spare[name] = empty(self.n, "float32", self._state[name])
        return self._spare[name]

    def _swap(self, name, new_state):
        self._spare[name], self._state[name] = self._state[name], new_state


class ErrorFeedback(Memory):
    """acc = grad + residual; residual = acc minus what was consumed.

    n : buffer length (elements).
    enabled : False turns error feedback off: acc = grad itself, the residual stays zero
        and whatever is not sent is dropped.
    """

    state_names = ("residual",)

    def __init__(self, n, enabled=True):
        super().__init__(n)
        self.enabled = bool(enabled)

    @property
    def residual(self):
        return self._state["residual"]

    def accumulate(self, grad):
        if not self.enabled:
            return grad
        self._bind(grad)
        if is_tensorflow(grad):
            return _float32(grad) + self.residual
        acc = self._spare_of("residual")
        backend(grad).add(grad, self.residual, out=acc)
        return acc

    def accumulate_pieces(self, pieces):
        """Without error feedback acc is the pieces fused."""
        self._bind(pieces[0])
        if is_tensorflow(pieces[0]):
            tf = sys.modules["tensorflow"]
            return tf.concat([_float32(piece) + self.residual[part] if self.enabled else _float32(piece)
                              for piece, part in _slices(pieces)], axis=0)
        acc = self._spare_of("residual")
        if _fuses_pieces(acc):
            sys.modules["torch"].cat(pieces, out=acc)
            return acc.add_(self.residual) if self.enabled else acc
        lib = backend(acc)
        for piece, part in _slices(pieces):
            if self.enabled:
                lib.add(_float32(piece), self.residual[part], out=acc[part])
            else:
                copy_into(acc[part], piece)
        return acc

    def commit_cleared(self, acc, cleared, where=None):
        if self.enabled:
            self._swap("residual", zero_at(acc, cleared, where))

    def commit_minus(self, acc, consumed):
        if self.enabled:
            if is_tensorflow(acc):
                self._swap("residual", acc - consumed)
                return
            backend(acc).subtract(acc, consumed, out=acc)
            self._swap("residual", acc)


class MomentumCorrection(Memory):
    """DGC's momentum correction and momentum factor masking (Lin et al., ICLR 2018).

    u = momentum * u + grad  (the velocity, ``velocity``)
    v = v + u                (the accumulated velocity, ``residual``; acc = v)

    After the exchange both u and v are cleared at the consumed indices, so a
    coordinate's stale momentum does not keep pushing after it was applied. The
    momentum lives here: train with plain SGD (momentum 0) on top of it.
    """

    state_names = ("residual", "velocity")
    enabled = True

    def __init__(self, n, momentum):
        super().__init__(n)
        self.momentum = float(momentum)

    @property
    def residual(self):
        return self._state["residual"]

    @property
    def velocity(self):
        return self._state["velocity"]

    def accumulate(self, grad):
        self._bind(grad)
        if is_tensorflow(grad):  # new tensors; u waits in the spare slot for the commit
            self._spare["velocity"] = self.velocity * self.momentum + _float32(grad)
            return self.residual + self._spare["velocity"]
        lib = backend(grad)
        u = _momentum_step(lib, self.velocity, self.momentum, grad, out=self._spare_of("velocity"))
        acc = self._spare_of("residual")
        lib.add(self.residual, u, out=acc)
        return acc

    def accumulate_pieces(self, pieces):
        """Slice by slice: the same float32 operations as :meth:`accumulate`."""
        self._bind(pieces[0])
        if is_tensorflow(pieces[0]):
            return self.accumulate(sys.modules["tensorflow"].concat([_float32(p) for p in pieces], axis=0))
        u = self._spare_of("velocity")
        acc = self._spare_of("residual")
        lib = backend(acc)
        if _fuses_pieces(acc):  # the gradient fused into acc, then acc's two passes
            sys.modules["torch"].cat(pieces, out=acc)
            _momentum_step(lib, self.velocity, self.momentum, acc, out=u)
            return lib.add(self.residual, u, out=acc)
        for piece, part in _slices(pieces):
            _momentum_step(lib, self.velocity[part], self.momentum, _float32(piece), out=u[part])
            lib.add(self.residual[part], u[part], out=acc[part])
        return acc

    def commit_cleared(self, acc, cleared, where=None):
        self._swap("velocity", zero_at(self._spare["velocity"], cleared, where))
        self._swap("residual", zero_at(acc, cleared, where))


class Momentum(Memory):
    """Signum's momentum: u = momentum * u + grad is what is sent; nothing is subtracted.

    Whatever the exchange consumed, committing keeps the new u whole (call it only once
    the exchange succeeded): :meth:`commit`, or either commit of :class:`Memory`.
    """

    state_names = ("momentum_buffer",)

    def __init__(self, n, momentum):
        super().__init__(n)
        self.momentum = float(momentum)

    @property
    def momentum_buffer(self):
        return self._state["momentum_buffer"]

    def accumulate(self, grad):
        self._bind(grad)
        if is_tensorflow(grad):  # a new tensor: the same two float32 operations
            return self.momentum_buffer * np.float32(self.momentum) + _float32(grad)
        return _momentum_step(backend(grad), self.momentum_buffer, self.momentum, grad,
                              out=self._spare_of("momentum_buffer"))

    def accumulate_pieces(self, pieces):
        """Slice by slice: the same float32 operations as :meth:`accumulate`."""
        self._bind(pieces[0])
        if is_tensorflow(pieces[0]):
            return self.accumulate(sys.modules["tensorflow"].concat([_float32(p) for p in pieces], axis=0))
        u = self._spare_of("momentum_buffer")
        lib = backend(u)
        if _fuses_pieces(u):  # the gradient fused into u, then u + momentum * u_old: the same sum
            sys.modules["torch"].cat(pieces, out=u)
            return u.add_(self.momentum_buffer * np.float32(self.momentum))
        for piece, part in _slices(pieces):
            _momentum_step(lib, self.momentum_buffer[part], self.momentum, _float32(piece), out=u[part])
        return u

    def commit(self, u, consumed=None):
        self._swap("momentum_buffer", u)

    commit_minus = commit_cleared = commit


def _momentum_step(lib, u, momentum, grad, out):
    """``out = momentum * u + grad`` in float32 (two in-place passes of ``lib``); returns ``out``."""
    lib.multiply(u, np.float32(momentum), out=out)
    lib.add(out, grad, out=out)
    return out


def _fuses_pieces(acc):
    """Whether a step's pieces are fused first (one ``torch.cat``, then whole-buffer passes)
    rather than visited one by one: torch tensors off the host's path, where each op is a
    kernel launch (a gradient's add is one; the extra pass over the buffer is cheap there).
    The same float32 operations: ``cat`` into float32 rounds a float64 piece as
    :func:`_float32` does and widens float16 / bfloat16 exactly."""
    return is_torch(acc) and not host_shortcut_allowed(acc)


def _slices(pieces):
    """(piece, the slice of the buffer it covers), for back-to-back 1-D pieces."""
    offset = 0
    for piece in pieces:
        yield piece, slice(offset, offset + int(piece.shape[0]))
        offset += int(piece.shape[0])


def _float32(piece):
    """The piece as a float32 add must see it: float16/bfloat16 promote exactly, so they are
    used as they are; float64 is rounded to float32 first, as a fused float32 buffer would be
    (TensorFlow does not promote: every piece is cast to float32, exactly for the narrower ones)."""
    if is_tensorflow(piece):
        return sys.modules["tensorflow"].cast(piece, "float32")
    if is_torch(piece):
        return piece.float() if piece.dtype == sys.modules["torch"].float64 else piece
    return piece.astype(VALUE_DTYPE) if piece.dtype == np.float64 else piece


def _convert(value, like):
    """``value`` (numpy or torch or TensorFlow) as float32 in ``like``'s library and device; a
    one-time move of state, not per-step traffic, so it is not counted as host traffic."""
    if is_tensorflow(like):
        tf = sys.modules["tensorflow"]
        with tf.device(like.device):
            return tf.constant(_numpy_copy(value))
    if is_torch(like):
        import torch
        t = value if is_torch(value) else torch.from_numpy(np.ascontiguousarray(value))
        return t.to(device=like.device, dtype=torch.float32).contiguous()
    return _numpy_copy(value)


def _numpy_copy(value):
    if is_tensorflow(value):
        return np.array(value.numpy(), dtype=VALUE_DTYPE, copy=True)
    if is_torch(value):
        return value.detach().cpu().numpy().astype(VALUE_DTYPE, copy=True)
    return np.array(value, dtype=VALUE_DTYPE, copy=True)


def _checked(d, key, n):
    array = np.array(d[key], dtype=VALUE_DTYPE).reshape(-1)
    if array.size != n:
        raise ValueError(f"state_dict {key} has {array.size} elements, this buffer has {n}")
    return array
