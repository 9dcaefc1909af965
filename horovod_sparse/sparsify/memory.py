"""What a sparsifier remembers between steps: the residual (error feedback) or DGC's momentum.

Both follow the same two-phase protocol so that a step that fails in the exchange
(e.g. an :class:`~horovod_sparse.exchange.ExchangeError`) changes nothing:

* ``accumulate(grad)`` returns the accumulated vector ``acc`` (a new float32 array)
  without touching the state;
* ``commit(acc, cleared)`` makes ``acc`` with zeros at ``cleared`` (sorted int64
  indices whose values were sent and consumed) the new state.

Conservation law (exact, bitwise): ``acc[cleared]`` (what was kept for sending)
and the new residual, which is ``acc`` with exact zeros at ``cleared``, add up to ``acc``.
"""
import numpy as np

from horovod_sparse.sparsify.selection import VALUE_DTYPE


class ErrorFeedback:
    """acc = grad + residual; residual = acc minus what was consumed.

    n : buffer length (elements).
    enabled : False turns error feedback off: acc = grad, the residual stays zero
        and whatever is not sent is dropped.
    """

    def __init__(self, n, enabled=True):
        self.enabled = bool(enabled)
        self.residual = np.zeros(n, VALUE_DTYPE)

    def accumulate(self, grad):
        return np.add(grad, self.residual, dtype=VALUE_DTYPE) if self.enabled else grad.copy()

    def commit(self, acc, cleared):
        if self.enabled:
            acc[cleared] = 0  # acc is ours (a fresh array): reuse it as the new residual
            self.residual = acc

    def state_dict(self):
        return {"residual": self.residual.copy()}

    def load_state_dict(self, d):
        self.residual = _checked(d, "residual", self.residual.size)


class MomentumCorrection:
    """DGC's momentum correction and momentum factor masking (Lin et al., ICLR 2018).

    u = momentum * u + grad  (the velocity, ``velocity``)
    v = v + u                (the accumulated velocity, ``residual``; acc = v)

    After the exchange both u and v are cleared at the consumed indices, so a
    coordinate's stale momentum does not keep pushing after it was applied. The
    momentum now lives here: train with plain SGD (momentum 0) on top of it.

    n : buffer length (elements).
    momentum : momentum factor in [0, 1).
    """

    enabled = True

    def __init__(self, n, momentum):
        self.momentum = float(momentum)
        self.velocity = np.zeros(n, VALUE_DTYPE)
        self.residual = np.zeros(n, VALUE_DTYPE)
        self._pending_velocity = None

    def accumulate(self, grad):
        velocity = np.multiply(self.velocity, VALUE_DTYPE.type(self.momentum), dtype=VALUE_DTYPE)
        velocity += grad
        self._pending_velocity = velocity
        return np.add(self.residual, velocity, dtype=VALUE_DTYPE)

    def commit(self, acc, cleared):
        velocity, self._pending_velocity = self._pending_velocity, None
        velocity[cleared] = 0
        acc[cleared] = 0
        self.velocity, self.residual = velocity, acc

    def state_dict(self):
        return {"residual": self.residual.copy(), "velocity": self.velocity.copy()}

    def load_state_dict(self, d):
        self.residual = _checked(d, "residual", self.residual.size)
        self.velocity = _checked(d, "velocity", self.velocity.size)


def _checked(d, key, n):
    array = np.array(d[key], dtype=VALUE_DTYPE).reshape(-1)
    if array.size != n:
        raise ValueError(f"state_dict {key} has {array.size} elements, this buffer has {n}")
    return array
