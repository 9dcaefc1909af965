"""Named scratch buffers reused from call to call, so a step allocates nothing large.

Allocating a 100 MB buffer costs more than computing in it (the first touch of every
page), so the codes keep their temporaries here, one per name, dtype, library and
device, grown when a larger count comes and never shrunk. A scratch buffer is only
ever used inside one call: nothing handed back to a caller lives here.
"""
from horovod_sparse.ops import namespace


class Scratch:
    """Grow-only temporaries of one owner (a codec, an exchange)."""

    def __init__(self):
        self._buffers = {}

    def get(self, name, count, dtype_name, like):
        """An uninitialised 1-D ``dtype_name`` buffer of ``count`` elements, in ``like``'s
        library and device; the same memory as the last ``get`` of that name (and dtype).
        None for a TensorFlow ``like``: its kernels make new tensors, there is nothing to reuse."""
        if namespace.is_tensorflow(like):
            return None
        key = (name, dtype_name, namespace.is_torch(like), str(getattr(like, "device", "")))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < count:
            buffer = namespace.empty(max(int(count), 1), dtype_name, like)
            self._buffers[key] = buffer
        return buffer[:count]

    def zeros(self, name, count, dtype_name, like):
        """Like :meth:`get`, filled with zeros."""
        buffer = self.get(name, count, dtype_name, like)
        buffer[...] = 0
        return buffer

    def arange(self, count, like):
        """int32 ``[0, count)`` (computed once per size reached, then sliced)."""
        key = ("arange", "int32", namespace.is_torch(like), str(getattr(like, "device", "")))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape[0] < count:
            buffer = namespace.namespace(like).astype(namespace.arange(max(int(count), 1), like),
                                                      namespace.dtype_of(like, "int32"))
            self._buffers[key] = buffer
        return buffer[:count]
