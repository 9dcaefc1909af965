"""numpy implementation of :class:`ArrayOps`: the reference the frameworks are tested against."""
import numpy as np

from horovod_sparse.ops.base import ArrayOps, random_indices


class NumpyOps(ArrayOps):
    name = "numpy"

    def dtype_name(self, t):
        # ml_dtypes' bfloat16 (what TensorFlow hands to numpy) names itself "bfloat16".
        return np.asarray(t).dtype.name

    def shape(self, t):
        return tuple(int(d) for d in np.shape(t))

    def cast(self, t, dtype_name):
        if dtype_name == "bfloat16":
            import ml_dtypes  # shipped with TensorFlow; only needed for bfloat16 arrays
            return np.asarray(t).astype(ml_dtypes.bfloat16)
        return np.asarray(t).astype(dtype_name)

    def reshape(self, t, shape):
        return np.reshape(t, shape)

    def zeros(self, shape, dtype_name, like=None):
        return self.cast(np.zeros(shape, dtype=np.float32), dtype_name)

    def gather(self, flat, indices):
        return flat[indices]

    def scatter(self, indices, values, n):
        out = np.zeros(n, dtype=values.dtype)
        out[indices] = values
        return out

    def accumulate(self, slot, t):
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught by all_finite
            return super().accumulate(slot, t)

    def fill_nan_(self, t):
        return np.full_like(t, np.nan)  # a new array: a caller's array is never written

    def random_indices(self, seed, stream, step, n, k, like=None):
        return random_indices(seed, stream, step, n, k)

    def to_numpy(self, t):
        return np.array(t)

    def from_numpy(self, a, like=None):
        return np.array(a, dtype=None if like is None else like.dtype)
