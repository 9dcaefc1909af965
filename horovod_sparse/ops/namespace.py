"""Which library and device an array lives in, and new buffers there.

The pipelines run one code over numpy arrays and torch tensors (CPU or CUDA). These
functions answer "numpy or torch?" without importing torch (a numpy-only or TensorFlow
run never loads it) and allocate 1-D buffers beside a given array.

Example::

    lib = backend(acc)                          # numpy, or torch for a tensor
    keys = empty(acc.shape[0], "int32", acc)    # same library and device as acc
    lib.greater_equal(acc, 0.5, out=mask)
"""
import sys

import numpy as np
from array_api_compat import array_namespace

from horovod_sparse.ops import cpu


def is_torch(x):
    """True for a torch tensor (checked without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def is_tensorflow(x):
    """True for a TensorFlow tensor (checked without importing TensorFlow). The pipelines see
    them only when they run as TensorFlow ops on the gradients' device (eagerly, inside the
    traced step's host call: :mod:`horovod_sparse.tensorflow.bucket_exchange`)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(x, tf.Tensor)


def host_shortcut_allowed(x):
    """Whether ``x``'s math may take the host's shortcuts (a zero-copy numpy view, a compiled
    kernel, numpy's allocator, host-sized chunks) instead of torch's own ops: numpy arrays
    always; torch tensors on the CPU unless the device path is chosen
    (``HOROVOD_SPARSE_KERNELS=torch``, :func:`~horovod_sparse.ops.cpu.device_path`), so that
    they then run exactly what a CUDA tensor runs; TensorFlow tensors never. The one rule every
    "CPU tensor -> numpy" decision asks."""
    if is_tensorflow(x):
        return False
    if not is_torch(x):
        return True
    return x.device.type == "cpu" and not cpu.device_path_chosen()


def library_of(x):
    """``"numpy"``, ``"torch"`` or ``"tensorflow"``, and the device (``""`` for numpy): where
    buffers made like ``x`` must live."""
    if is_torch(x):
        return "torch", str(x.device)
    if is_tensorflow(x):
        return "tensorflow", x.device
    return "numpy", ""


def namespace(x):
    """The array API namespace of ``x`` (numpy's or torch's, via array_api_compat): for
    everything the standard covers (elementwise math, ``take``, ``where``, ``linalg``, ``fft``)."""
    return array_namespace(x)


def backend(x):
    """The raw library of ``x``: ``torch`` for a tensor, else ``numpy``. Both spell the in-place
    kernels the standard leaves out the same way (``add(a, b, out=c)``, ``subtract``,
    ``multiply``, ``greater_equal``, ``bitwise_and``), which keeps a step to a few passes over
    the gradient without allocating. TensorFlow tensors are immutable and have no such kernels:
    code that runs on them branches on :func:`is_tensorflow` before it asks for a backend."""
    if is_tensorflow(x):
        raise TypeError("a TensorFlow tensor has no in-place (out=) kernels: this step has no "
                        "TensorFlow spelling (run it on numpy)")
    return sys.modules["torch"] if is_torch(x) else np


def dtype_of(x, name):
    """The dtype called ``name`` ("float32", "int64", ...) in ``x``'s library."""
    if is_tensorflow(x):
        return getattr(sys.modules["tensorflow"], name)
    return getattr(backend(x), name)


def itemsize(x):
    """Bytes per element of a numpy array or torch (or TensorFlow) tensor."""
    if is_tensorflow(x):
        return x.dtype.size
    return x.element_size() if is_torch(x) else x.itemsize


def empty(n, dtype_name, like):
    """An uninitialised 1-D buffer of ``n`` elements in ``like``'s library and device
    (TensorFlow: zeros, it has no uninitialised tensors)."""
    if is_tensorflow(like):
        return zeros(n, dtype_name, like)
    if is_torch(like):
        return sys.modules["torch"].empty(n, dtype=dtype_of(like, dtype_name), device=like.device)
    return np.empty(n, dtype=dtype_name)


def new_empty(n, dtype_name, like):
    """Like :func:`empty`, for a buffer handed back to the caller (fresh each call): a CPU
    tensor's memory comes from numpy, which asks for transparent huge pages, so its first
    touch costs ~5x less than torch's allocator (100 MB: ~6 vs ~39 ms here)."""
    if is_torch(like) and host_shortcut_allowed(like):
        return sys.modules["torch"].from_numpy(np.empty(n, dtype=dtype_name))
    return empty(n, dtype_name, like)


def zeros(n, dtype_name, like):
    """Zeros, 1-D, ``n`` elements, in ``like``'s library and device."""
    if is_tensorflow(like):
        tf = sys.modules["tensorflow"]
        with tf.device(like.device):
            return tf.zeros([n], dtype=dtype_name)
    if is_torch(like):
        return sys.modules["torch"].zeros(n, dtype=dtype_of(like, dtype_name), device=like.device)
    return np.zeros(n, dtype=dtype_name)


def arange(n, like):
    """int64 ``[0, n)`` in ``like``'s library and device."""
    if is_tensorflow(like):
        tf = sys.modules["tensorflow"]
        with tf.device(like.device):
            return tf.range(n, dtype=tf.int64)
    if is_torch(like):
        return sys.modules["torch"].arange(n, dtype=sys.modules["torch"].int64, device=like.device)
    return np.arange(n, dtype=np.int64)


def copy_of(x):
    """A copy of ``x`` that nothing else writes to (TensorFlow tensors are immutable: ``x`` itself)."""
    if is_tensorflow(x):
        return x
    return x.clone() if is_torch(x) else x.copy()


def concat_float32(pieces):
    """The 1-D float pieces back to back in one new float32 buffer, in their library and device."""
    if pieces and is_tensorflow(pieces[0]):
        tf = sys.modules["tensorflow"]
        return tf.concat([tf.cast(p, tf.float32) for p in pieces], axis=0)
    if pieces and is_torch(pieces[0]):
        torch = sys.modules["torch"]
        return torch.cat([p.to(torch.float32) for p in pieces])
    return np.concatenate([np.asarray(p, dtype=np.float32) for p in pieces]) if pieces else np.empty(0, np.float32)
