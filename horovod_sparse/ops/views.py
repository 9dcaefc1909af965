"""Zero-copy views: the same memory seen through another library or another dtype.

On a CPU tensor, numpy's single-threaded kernels run on a zero-copy view of the same
memory 2-5x faster than torch's (measured at 25M int32: >= 12 vs 5 ms, nonzero 26-32 vs
6 ms, kthvalue 355 vs 155 ms; 25M-element rfft 38 vs 90 ms, 4096 x 2048 M^T P at rank 4
5 vs 49 ms). The results are the numpy path's bits, so numpy and CPU torch agree exactly.

Example::

    view = kernel_view(acc)                 # numpy for numpy or a CPU tensor, else acc
    spectrum = as_like(np.fft.rfft(view), acc)
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import dtype_of, host_shortcut_allowed, is_torch, itemsize

_SIGNED_OF_SIZE = {2: "int16", 4: "int32", 8: "int64"}


def numpy_view(x):
    """A zero-copy numpy view of a numpy array or a CPU tensor (strides kept); None on other
    devices, on the device path (:func:`~horovod_sparse.ops.namespace.host_shortcut_allowed`),
    and for TensorFlow tensors (they reach the pipelines only to run TensorFlow's ops)."""
    if not host_shortcut_allowed(x):
        return None
    return x.detach().numpy() if is_torch(x) else x


def kernel_view(x, numpy_on_cpu=True):
    """The array the math runs on: :func:`numpy_view` of numpy or a CPU tensor, else ``x``
    itself. ``numpy_on_cpu=False`` keeps torch's own kernels (what a CUDA tensor runs)."""
    view = numpy_view(x) if numpy_on_cpu else None
    return x if view is None else view


def as_like(a, like):
    """A kernel's result in ``like``'s library: numpy for a CPU tensor becomes a zero-copy
    tensor; anything else is returned as it is."""
    return sys.modules["torch"].from_numpy(a) if is_torch(like) and not is_torch(a) else a


def int_view(x):
    """The bits of a float array as the signed integer of its size (float32: int32), without a copy."""
    return x.view(dtype_of(x, _SIGNED_OF_SIZE[itemsize(x)]))


def complex_view(x):
    """The complex64 view (no copy) of a contiguous float32 1-D buffer of (re, im) pairs."""
    if is_torch(x):
        return sys.modules["torch"].view_as_complex(x.view(-1, 2))
    return x.view(np.complex64)


class ReusedResult:
    """A pipeline's float32 result buffer of ``n`` on the CPU, reused from step to step once the
    caller let go of the last one, else new (a caller may keep a result past the next step).
    A fresh 100 MB buffer costs the kernel's zeroing of its pages at every step (4 ms here with
    numpy's huge pages, 22 ms with torch's allocator: ``studies/time_kernels.py``).

    Example::

        results = ReusedResult(n)
        out = results.like(acc)    # numpy, or a CPU tensor's zero-copy view; None on a GPU
    """

    def __init__(self, n):
        self.n, self._buffer = int(n), None

    def like(self, like):
        """The buffer in ``like``'s library (numpy or a zero-copy CPU tensor): the last one if
        nothing else refers to it (a returned tensor or a view of it does), else a new one;
        None where ``like`` is not on the CPU (the caller allocates there)."""
        if numpy_view(like) is None:
            return None
        # referenced by the attribute and getrefcount's argument only: the caller let go
        if self._buffer is None or sys.getrefcount(self._buffer) > 2:
            self._buffer = np.empty(self.n, np.float32)
        return as_like(self._buffer, like)
