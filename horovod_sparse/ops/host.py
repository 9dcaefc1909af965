"""Crossing to the host and back, counted: what leaves the framework for mpi4py.

What crosses ranks leaves the framework through :func:`to_host` and comes back through
:func:`from_host`; both count the crossings and bytes of torch tensors
(:data:`HOST_TRAFFIC`), so a test can prove that only the exchanged payload leaves the
device, never the gradient. A few values the host needs to go on (where a gradient's pairs
start) are read back by :func:`to_list`, counted as reads: on a CPU tensor ``.tolist()``
and ``.numpy()`` never reach torch's dispatcher, so only these counters see them
(:mod:`horovod_sparse.ops.counting`).

A step that sends or receives several arrays (a sparse exchange's indices and values) crosses
once each way: :func:`to_host_packed` and :func:`from_host_packed` pack them byte-wise into one
buffer on the side they leave, and hand out views on the other. A CUDA tensor crosses through
pinned host memory (torch's caching host allocator reuses the blocks from step to step) with an
asynchronous copy: one wait on the way out, none on the way in.

Where the transport takes device memory (MPI with CUDA support:
:meth:`horovod_sparse.exchange.comm.CountingComm.takes_device_buffer`), nothing crosses:
:func:`to_wire` hands the tensor itself to mpi4py and :func:`from_wire` takes back what the
collective wrote beside it, counted as handed (``handed_out``, ``handed_in``), not as transfers.

Example::

    HOST_TRAFFIC.reset()
    ...                                 # one step
    assert HOST_TRAFFIC.largest <= payload_bytes
"""
import sys

import numpy as np

from horovod_sparse.ops.namespace import host_shortcut_allowed, is_tensorflow, is_torch


class HostTraffic:
    """Crossings and bytes of torch tensors copied (or viewed) off the framework by
    :func:`to_host`, and back by :func:`from_host`; values read back by :func:`to_list`."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.bytes_out, self.bytes_in, self.largest = 0, 0, 0
        self.transfers_out, self.transfers_in, self.reads = 0, 0, 0
        self.handed_out, self.handed_in = 0, 0  # device buffers given to MPI, received from it

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
                "transfers_in": self.transfers_in, "bytes_in": self.bytes_in, "reads": self.reads,
                "handed_out": self.handed_out, "handed_in": self.handed_in}


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
    if x.is_cuda:
        return _pinned_copy_of(x)
    return x.contiguous().cpu().numpy()


def to_wire(x, comm):
    """What mpi4py is handed to send ``x`` over ``comm`` (a
    :class:`~horovod_sparse.exchange.comm.CountingComm`): the tensor itself, contiguous, where
    the transport takes device buffers (counted as handed; a CUDA tensor once its stream has
    finished writing it, since MPI reads it on none of torch's streams), else :func:`to_host`'s
    host array."""
    if not is_torch(x) or host_shortcut_allowed(x) or not comm.takes_device_buffer(x):
        return to_host(x)
    x = x.detach().contiguous()
    HOST_TRAFFIC.handed_out += 1
    if x.is_cuda:
        sys.modules["torch"].cuda.current_stream(x.device).synchronize()
    return x


def from_wire(a, like):
    """What a collective returned, in ``like``'s library and device: a tensor the transport
    wrote beside a handed buffer (:func:`to_wire`) as it is, counted as handed; a host array
    as :func:`from_host` brings it back."""
    if is_torch(a):
        HOST_TRAFFIC.handed_in += 1
        return a
    return from_host(a, like)


def to_host_packed(*xs):
    """:func:`to_host` of several tensors in one crossing: a list of numpy arrays, one per
    argument, in order. Tensors that must cross (on a GPU, or on the device path) are packed
    byte-wise on their device by one ``cat`` (widest dtype first, so every piece stays aligned),
    crossed once, and handed out as views of the host buffer; anything else crosses as
    :func:`to_host` does (numpy and a CPU tensor's zero-copy view cost nothing to cross)."""
    if not all(is_torch(x) and not host_shortcut_allowed(x) for x in xs) or len(xs) < 2:
        return [to_host(x) for x in xs]
    torch = sys.modules["torch"]
    flat = [x.detach().reshape(-1) for x in xs]
    layout = _packing([(x.element_size(), x.numel() * x.element_size()) for x in flat])
    packed = to_host(torch.cat([_bytes_of(flat[i]) for i, _ in layout]))
    out = [None] * len(flat)
    for i, part in layout:
        out[i] = packed[part].view(_numpy_dtype(flat[i].dtype))
    return out


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
    torch = sys.modules["torch"]
    if like.is_cuda:
        pinned = torch.empty(a.shape, dtype=_torch_dtype(a.dtype), pin_memory=True)  # a cached block
        pinned.numpy()[...] = a
        # asynchronous from pinned memory: the allocator keeps the block until the copy is done
        return pinned.to(like.device, non_blocking=True)
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t if like.device.type == "cpu" else t.to(like.device)


def from_host_packed(arrays, like):
    """:func:`from_host` of several numpy arrays in one crossing: a list of tensors in
    ``like``'s library and device, one per array. Where ``like`` must cross (a GPU tensor, or
    the device path), the arrays are packed byte-wise on the host (widest dtype first), crossed
    once, and handed out as views (dtype views of slices: no kernel); anything else as
    :func:`from_host` does."""
    arrays = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    if not is_torch(like) or host_shortcut_allowed(like) or len(arrays) < 2:
        return [from_host(a, like) for a in arrays]
    layout = _packing([(a.itemsize, a.nbytes) for a in arrays])
    packed = from_host(np.concatenate([arrays[i].view(np.uint8) for i, _ in layout]), like)
    out = [None] * len(arrays)
    for i, part in layout:
        out[i] = packed[part].view(_torch_dtype(arrays[i].dtype))
    return out


def _packing(pieces):
    """Where each piece goes in a packed byte buffer: ``[(index, byte slice)]`` in packing
    order, widest item first so that every piece's offset is a multiple of its item size (a
    dtype view of its slice needs that). ``pieces``: ``(item size, bytes)`` per piece."""
    layout, offset = [], 0
    for i in sorted(range(len(pieces)), key=lambda i: -pieces[i][0]):
        layout.append((i, slice(offset, offset + pieces[i][1])))
        offset += pieces[i][1]
    return layout


def _pinned_copy_of(x):
    """A CUDA tensor's values in pinned host memory, as numpy: one asynchronous copy and one
    wait for it (pageable memory would stage through a driver buffer, synchronously)."""
    torch = sys.modules["torch"]
    pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)  # a cached block, reused
    pinned.copy_(x, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(x.device))
    done.synchronize()
    return pinned.numpy()  # keeps the pinned tensor alive


def _bytes_of(x):
    """A 1-D tensor's bytes, as a uint8 view (an empty one may have stride 0, which no view takes)."""
    torch = sys.modules["torch"]
    return x.view(torch.uint8) if x.numel() else x.new_empty(0, dtype=torch.uint8)


def _numpy_dtype(dtype):
    """numpy's dtype of a torch dtype (torch.float32 -> float32), by name: no op dispatched."""
    return np.dtype(str(dtype).removeprefix("torch."))


def _torch_dtype(dtype):
    """torch's dtype of a numpy dtype (float32 -> torch.float32), by name."""
    return getattr(sys.modules["torch"], np.dtype(dtype).name)
