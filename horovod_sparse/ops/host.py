"""Crossing to the host and back, counted: what leaves the framework for mpi4py.

What crosses ranks leaves the framework through :func:`to_host` and comes back through
:func:`from_host`; both count the bytes of torch tensors that cross
(:data:`HOST_TRAFFIC`), so a test can prove that only the exchanged payload leaves the
device, never the gradient.

Example::

    HOST_TRAFFIC.reset()
    ...                                 # one step
    assert HOST_TRAFFIC.largest <= payload_bytes
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import is_tensorflow, is_torch


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
    memory (a zero-copy view for a contiguous CPU tensor). Counted in :data:`HOST_TRAFFIC`
    (TensorFlow tensors too)."""
    if is_tensorflow(x):
        HOST_TRAFFIC.count(int(x.shape.num_elements()) * x.dtype.size, outbound=True)
        return x.numpy()
    if not is_torch(x):
        return np.asarray(x)
    x = x.detach()
    HOST_TRAFFIC.count(x.numel() * x.element_size(), outbound=True)
    return x.contiguous().cpu().numpy()


def from_host(a, like):
    """A numpy array received from mpi4py, in ``like``'s library and device (no copy on
    numpy or a CPU tensor). Counted in :data:`HOST_TRAFFIC`."""
    a = np.asarray(a)
    if is_tensorflow(like):
        HOST_TRAFFIC.count(a.nbytes, outbound=False)
        tf = sys.modules["tensorflow"]
        with tf.device(like.device):
            return tf.constant(a)
    if not is_torch(like):
        return a
    HOST_TRAFFIC.count(a.nbytes, outbound=False)
    t = sys.modules["torch"].from_numpy(np.ascontiguousarray(a))
    return t if like.device.type == "cpu" else t.to(like.device, non_blocking=True)
