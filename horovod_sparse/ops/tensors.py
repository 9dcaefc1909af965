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
