"""Inputs that stress the compiled CPU kernels (horovod_sparse.ops.cpu) where they could part from
numpy: ties, zeros of both signs, denormals, overflows, and buffers that start off alignment."""
import numpy as np

KINDS = ["normal", "ties", "zeros", "denormals", "nonfinite"]


def adversarial(n, rng, kind, ties=(-1.5, 1.5, 0.5, -0.0, 0.0), scale=1.0):
    """A float32 vector of ``n`` entries of one ``kind``: standard normal times ``scale``; only
    the values of ``ties``; zeros of both signs; denormals; or normal with about 2% inf and NaN."""
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if kind == "ties":
        x = rng.choice(np.array(ties, np.float32), n)
    elif kind == "zeros":
        x = np.where(rng.random(n) < 0.5, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
    elif kind == "denormals":
        x = (rng.standard_normal(n) * 1e-41).astype(np.float32)
    elif kind == "nonfinite" and n:
        x[rng.integers(0, n, max(1, n // 50))] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32))
    return x


def unaligned(x):
    """The same float32 values in a buffer that starts 4 bytes past an allocation (not vector-aligned)."""
    base = np.empty(x.size + 1, np.float32)
    base[1:] = x
    return base[1:]
