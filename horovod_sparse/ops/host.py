"""Crossing to the host and back, counted: what leaves the framework for mpi4py.

What crosses ranks leaves the framework through :func:`to_host` and comes back through
:func:`from_host`; both count the crossings and bytes of torch tensors
(:data:`HOST_TRAFFIC`), so a test can prove that only the exchanged payload leaves the
device, never the gradient. A few values the host needs to go on (where a gradient's pairs
start) are read back by :func:`to_list`, counted as reads: on a CPU tensor ``.tolist()``
and ``.numpy()`` never reach torch's dispatcher, so only these counters see them
(:mod:`horovod_sparse.ops.counting`).

Example::

    HOST_TRAFFIC.reset()
    ...                                 # one step
    assert HOST_TRAFFIC.largest <= payload_bytes
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import is_tensorflow, is_torch


class HostTraffic:
    """Crossings and bytes of torch tensors copied (or viewed) off the framework by
    :func:`to_host`, and back by :func:`from_host`; values read back by :func:`to_list`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.bytes_out, self.bytes_in, self.largest = 0, 0, 0
        self.transfers_out, self.transfers_in, self.reads = 0, 0, 0

    @property
    def bytes(self):
        return self.bytes_out + self.bytes_in

    def count(self, nbytes, outbound):
        if outbound:
            self.bytes_out += nbytes
            self.transfers_out += 1
        else:
            self.bytes_in += nbytes
            self.transfers_in += 1
        self.largest = max(self.largest, nbytes)

    def snapshot(self):
        """The counters now, as a dict (a step's are the difference of two)."""
        return {"transfers_out": self.transfers_out, "bytes_out": self.bytes_out,
                "transfers_in": self.transfers_in, "bytes_in": self.bytes_in, "reads": self.reads}


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


def to_list(x):
    """A torch tensor's values as Python numbers: a read-back the host waits for (a
    synchronisation on a GPU), counted in :data:`HOST_TRAFFIC` ``.reads``."""
    HOST_TRAFFIC.reads += 1
    return x.tolist()


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
