"""The memory's first pass with the overflow check: what every out-of-band pipeline reads first.

What they replace (numpy, a pass each, :mod:`horovod_sparse.memory` and
:mod:`horovod_sparse.ops.finite`): ``acc = grad + residual`` (error feedback), ``u = momentum
* u + grad`` (Signum's momentum) or ``acc[...] = grad`` (no memory: pieces fused into a
reused buffer), then ``all_finite(acc)``. Here one loop reads the inputs, writes the sums and
tells whether every sum is finite on the way (an integer OR of ``(v - v) != 0``: inf - inf
and NaN - NaN are NaN; vectorised), at the speed of numpy's add alone. Called once per piece
where a step's gradients come as pieces (the slices of the state and of acc at the piece's
offset), so the pieces are read where they are.

Bits: the same float32 operations per element as numpy's (the product rounded, then the sum),
so the results are numpy's bit for bit.

Example::

    finite = accumulate_finite(grad, residual, acc)     # acc = grad + residual
    finite = copy_finite(piece, acc[offset:offset + piece.size])
"""
import numpy as np

from horovod_sparse.ops.cpu import jit


@jit
def accumulate_finite(grad, residual, acc):
    """``acc = grad + residual`` (float32, 1-D, same length); returns True when every element
    of acc is finite. Replaces ``np.add(grad, residual, out=acc)`` + ``all_finite(acc)``."""
    bad = np.uint8(0)
    for i in range(acc.shape[0]):
        v = grad[i] + residual[i]
        acc[i] = v
        bad |= np.uint8((v - v) != np.float32(0))  # inf - inf and NaN - NaN are NaN
    return bad == 0


@jit
def copy_finite(grad, acc):
    """``acc[:] = grad`` (float32, 1-D, same length); returns True when every element is finite.
    Replaces ``acc[...] = grad`` + ``all_finite(acc)``."""
    bad = np.uint8(0)
    for i in range(acc.shape[0]):
        v = grad[i]
        acc[i] = v
        bad |= np.uint8((v - v) != np.float32(0))
    return bad == 0


@jit
def momentum_finite(grad, velocity, momentum, out):
    """``out = momentum * velocity + grad`` (float32: the product rounded, then the sum; ``momentum``
    a float32); returns True when every element of out is finite. Replaces
    :func:`horovod_sparse.memory._momentum_step` (numpy multiply, then add) + ``all_finite(out)``."""
    bad = np.uint8(0)
    for i in range(out.shape[0]):
        v = velocity[i] * momentum + grad[i]
        out[i] = v
        bad |= np.uint8((v - v) != np.float32(0))
    return bad == 0
