"""The array vocabulary of the out-of-band pipelines: one code for numpy and PyTorch.

The pipelines (sparsifiers, quantizers, PowerSGD, FFT) take a flat float32 buffer that
is either a numpy array (the reference oracle, and the TensorFlow frontend's host
buffers) or a torch tensor on the gradient's own device, and run the same code on it:

* :func:`namespace` is the array API namespace (``array_api_compat``) for everything the
  standard covers (elementwise math, ``take``, ``where``, ``linalg``, ``fft`` ...);
* :func:`backend` is the raw library (``numpy`` or ``torch``), for the in-place kernels
  the standard leaves out: both spell ``add(a, b, out=c)``, ``abs(a, out=c)``,
  ``greater_equal(a, b, out=m)``, ``subtract``, ``multiply`` the same way, which is what
  keeps a step to a few passes over the gradient without allocating;
* a handful of helpers whose spelling differs between the two (:func:`flatnonzero`,
  :func:`magnitude_keys`, :func:`int_view` ...).

What crosses ranks leaves the framework through :func:`to_host` and comes back through
:func:`from_host`; both count the bytes of torch tensors that cross (:data:`HOST_TRAFFIC`),
so a test can prove that only the exchanged payload leaves the device, never the
gradient (``HOST_TRAFFIC.reset()``, run a step, read ``HOST_TRAFFIC.bytes``).

Example::

    acc = ...                                   # float32, numpy or torch
    keys = magnitude_keys(acc, out=scratch)     # int32, ordered like |acc|, NaN largest
    picked = flatnonzero(keys >= key_of(0.5))   # int64 indices, same library/device
"""
import struct
import sys

import numpy as np
from array_api_compat import array_namespace

#: value dtype of every pipeline buffer
VALUE_DTYPE = "float32"
_SIGN_CLEAR = 0x7FFFFFFF


def is_torch(x):
    """True for a torch tensor (checked without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def namespace(x):
    """The array API namespace of ``x`` (numpy's or torch's, via array_api_compat)."""
    return array_namespace(x)


def backend(x):
    """The raw library of ``x``: ``torch`` for a tensor, else ``numpy``."""
    return sys.modules["torch"] if is_torch(x) else np


def dtype_of(x, name):
    """The dtype called ``name`` ("float32", "int64", ...) in ``x``'s library."""
    return getattr(backend(x), name)


def empty(n, dtype_name, like):
    """An uninitialised 1-D buffer of ``n`` elements in ``like``'s library and device."""
    if is_torch(like):
        return sys.modules["torch"].empty(n, dtype=dtype_of(like, dtype_name), device=like.device)
    return np.empty(n, dtype=dtype_name)


def zeros(n, dtype_name, like):
    """Zeros, 1-D, ``n`` elements, in ``like``'s library and device."""
    if is_torch(like):
        return sys.modules["torch"].zeros(n, dtype=dtype_of(like, dtype_name), device=like.device)
    return np.zeros(n, dtype=dtype_name)


def arange(n, like):
    """int64 ``[0, n)`` in ``like``'s library and device."""
    if is_torch(like):
        return sys.modules["torch"].arange(n, dtype=sys.modules["torch"].int64, device=like.device)
    return np.arange(n, dtype=np.int64)


def int_view(x):
    """The bits of a float32 array as int32, without a copy."""
    return x.view(dtype_of(x, "int32"))


def magnitude_keys(x, out=None):
    """int32 keys ordered like ``|x|`` for float32 ``x``: the bits with the sign cleared.

    +inf lies above every finite value and NaN above +inf, so NaN counts as largest.
    Exact integer comparisons: no rounding can make two runs (or numpy and torch) differ.
    ``out`` (an int32 buffer of the same length) avoids an allocation.
    """
    lib = backend(x)
    return lib.bitwise_and(int_view(x), _SIGN_CLEAR, out=out)


def key_of(magnitude):
    """The key of a non-negative float ``magnitude`` rounded to float32 (a Python int)."""
    return struct.unpack("<i", struct.pack("<f", abs(float(magnitude))))[0] & _SIGN_CLEAR


def magnitude_of(key):
    """Inverse of :func:`key_of`: the float32 magnitude whose key is ``key``."""
    return struct.unpack("<f", struct.pack("<i", int(key) & _SIGN_CLEAR))[0]


def flatnonzero(mask):
    """int64 indices of the true entries of a 1-D bool array, sorted, same library/device."""
    if is_torch(mask):
        return mask.nonzero().view(-1)
    return np.flatnonzero(mask)


def count_nonzero(mask):
    """Number of true entries, as a Python int."""
    return int(backend(mask).count_nonzero(mask))


def searchsorted(sorted_values, values):
    """Left insertion points of ``values`` in ``sorted_values`` (int64)."""
    return backend(sorted_values).searchsorted(sorted_values, values)


def concat(pieces, like):
    """Concatenate 1-D arrays of ``like``'s library."""
    return backend(like).concatenate(pieces) if not is_torch(like) else sys.modules["torch"].cat(pieces)


class HostTraffic:
    """Bytes of torch tensors copied (or viewed) off the framework by :func:`to_host`,
    and back by :func:`from_host`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.bytes_out, self.bytes_in, self.largest = 0, 0, 0

    @property
    def bytes(self):
        return self.bytes_out + self.bytes_in

    def count(self, nbytes, outbound):
        if outbound:
            self.bytes_out += nbytes
        else:
            self.bytes_in += nbytes
        self.largest = max(self.largest, nbytes)


#: what left and re-entered torch through :func:`to_host` / :func:`from_host`
HOST_TRAFFIC = HostTraffic()


def to_host(x):
    """A numpy array for mpi4py: ``x`` itself if numpy, else the tensor copied to host
    memory (a zero-copy view for a contiguous CPU tensor). Counted in :data:`HOST_TRAFFIC`."""
    if not is_torch(x):
        return np.asarray(x)
    x = x.detach()
    HOST_TRAFFIC.count(x.numel() * x.element_size(), outbound=True)
    return x.contiguous().cpu().numpy()


def from_host(a, like):
    """A numpy array received from mpi4py, in ``like``'s library and device (no copy on
    numpy or a CPU tensor). Counted in :data:`HOST_TRAFFIC`."""
    a = np.asarray(a)
    if not is_torch(like):
        return a
    HOST_TRAFFIC.count(a.nbytes, outbound=False)
    t = sys.modules["torch"].from_numpy(np.ascontiguousarray(a))
    return t if like.device.type == "cpu" else t.to(like.device, non_blocking=True)


# -- added for the sparsifiers' hot path ---------------------------------------------------
# On a CPU tensor, numpy's single-threaded kernels run on a zero-copy view of the same
# memory 2-5x faster than torch's (measured at 25M int32: >= 12 vs 5 ms, nonzero 26-32 vs
# 6 ms, kthvalue 355 vs 155 ms); the results are integers, so they are the same bits.

def numpy_view(x):
    """A zero-copy numpy view of a numpy array or a CPU tensor (strides kept); None on other devices."""
    if not is_torch(x):
        return x
    return x.detach().numpy() if x.device.type == "cpu" else None


def count_at_least(keys, key, out):
    """Write ``keys >= key`` into the bool buffer ``out`` (like ``keys``); return how many are true."""
    view = numpy_view(keys)
    if view is not None:
        return int(np.count_nonzero(np.greater_equal(view, key, out=numpy_view(out))))
    return int(sys.modules["torch"].ge(keys, key, out=out).sum())


def compact(mask):
    """Like :func:`flatnonzero` (sorted int64 indices of the true entries, same library and
    device), with numpy's kernel on a zero-copy view of a CPU tensor."""
    view = numpy_view(mask)
    if view is None:
        return flatnonzero(mask)
    found = np.flatnonzero(view)
    return sys.modules["torch"].from_numpy(found) if is_torch(mask) else found


def kth_largest(x, k):
    """The ``k``-th largest entry (1 <= k <= size) of a 1-D integer array, as a Python int."""
    n = x.shape[0]
    view = numpy_view(x)
    if view is not None:
        return int(np.partition(view, n - k)[n - k])
    return int(sys.modules["torch"].kthvalue(x, n - k + 1).values)


def take(x, indices):
    """``x[indices]`` for 1-D ``x`` and int64 ``indices`` (torch: index_select, ~3x faster)."""
    return sys.modules["torch"].index_select(x, 0, indices) if is_torch(x) else x[indices]


def put(x, indices, values):
    """``x[indices] = values`` in place, for 1-D ``x`` (torch: index_copy_, ~2x faster)."""
    if is_torch(x):
        x.index_copy_(0, indices, values)
    else:
        x[indices] = values


# -- added for the quantizers ----------------------------------------------------------------

def new_empty(n, dtype_name, like):
    """Like :func:`empty`, for a buffer handed back to the caller (fresh each call): a CPU
    tensor's memory comes from numpy, which asks for transparent huge pages, so its first
    touch costs ~5x less than torch's allocator (100 MB: ~6 vs ~39 ms here)."""
    if is_torch(like) and like.device.type == "cpu":
        return sys.modules["torch"].from_numpy(np.empty(n, dtype=dtype_name))
    return empty(n, dtype_name, like)


def bfloat16_bits(x, out):
    """Write the int16 bits of float32 ``x`` rounded to bfloat16 (nearest, ties to even) into
    ``out`` (int16, same length); a NaN gives some NaN code (torch's cast), callers fix NaNs."""
    if is_torch(x):
        return out.view(sys.modules["torch"].bfloat16).copy_(x)
    bits = int_view(x)  # bits + 0x7FFF + (bit 16), then the top half: wraps only for NaNs
    rounded = np.right_shift(bits, 16)
    rounded &= 1
    rounded += bits
    rounded += 0x7FFF
    rounded >>= 16
    np.copyto(out, rounded, casting="unsafe")
    return out


def isin_sorted(a, b):
    """Bool mask over ``a``: which entries are in ``b`` (both 1-D, sorted, unique, same
    library/device). numpy's kernel on CPU (~3x faster than torch.isin on one thread)."""
    a_view, b_view = numpy_view(a), numpy_view(b)
    if a_view is None or b_view is None:
        return sys.modules["torch"].isin(a, b, assume_unique=True)
    found = np.isin(a_view, b_view, assume_unique=True)
    return sys.modules["torch"].from_numpy(found) if is_torch(a) else found


def cast_into(dst, src):
    """``dst[...] = src`` across dtypes (float -> int truncates toward zero; values must fit).
    CPU tensors convert through numpy on zero-copy views: torch's float32 -> uint8 kernel is
    ~3x slower here (25M: 13 vs 4.6 ms); the values are the same."""
    if is_torch(dst) and dst.device.type == "cpu" and is_torch(src) and src.device.type == "cpu":
        np.copyto(dst.detach().numpy(), src.detach().numpy(), casting="unsafe")
    else:
        dst[...] = src
    return dst


# -- added for PowerSGD and the FFT ----------------------------------------------------------

def kernel_view(x, numpy_on_cpu=True):
    """The array the math runs on: a zero-copy numpy view of numpy or a CPU tensor (on one
    thread numpy's FFT and BLAS beat torch's: 25M-element rfft 38 vs 90 ms, 4096 x 2048
    M^T P at rank 4 5 vs 49 ms; same memory, and the numpy path's bits), else ``x`` itself.
    ``numpy_on_cpu=False`` keeps torch's own kernels (what a CUDA tensor runs)."""
    view = numpy_view(x) if numpy_on_cpu else None
    return x if view is None else view


def as_like(a, like):
    """A kernel's result in ``like``'s library: numpy for a CPU tensor becomes a zero-copy
    tensor; anything else is returned as it is."""
    return sys.modules["torch"].from_numpy(a) if is_torch(like) and not is_torch(a) else a


def complex_view(x):
    """The complex64 view (no copy) of a contiguous float32 1-D buffer of (re, im) pairs."""
    if is_torch(x):
        return sys.modules["torch"].view_as_complex(x.view(-1, 2))
    return x.view(np.complex64)


def kth_largests(x, ks):
    """Like :func:`kth_largest` for several ``ks`` at once (Python ints, in the order of
    ``ks``): on numpy and CPU tensors ONE partition serves them all."""
    n, view = x.shape[0], numpy_view(x)
    if view is None:
        return [kth_largest(x, k) for k in ks]
    found = np.partition(view, sorted({n - k for k in ks}))
    return [int(found[n - k]) for k in ks]


def less_into(x, value, out):
    """``out[...] = x < value`` into the bool buffer ``out``. CPU tensors compare through numpy
    on zero-copy views: torch's comparison into bool is ~2.5x slower here (25M: 10.6 vs 4 ms)."""
    if is_torch(x) and x.device.type == "cpu":
        np.less(x.detach().numpy(), value, out=out.numpy())
    else:
        backend(x).less(x, value, out=out)
    return out
