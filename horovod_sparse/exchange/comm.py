"""The only place where the exchange engine talks MPI: counted, buffer-based calls.

Every algorithm goes through :class:`CountingComm`, so no byte escapes counting
and no lowercase (pickle-based) mpi4py call is ever made.

Counting model.  Point-to-point calls are counted exactly (buffer size, one
message).  For collectives MPI chooses its own algorithm, so we count the
volume of a documented reference algorithm, the one the papers' cost models use:

* ``allgather`` / ``allgatherv``: direct exchange - this rank sends its block to
  each of the P-1 others and receives every other block once.
* ``alltoall``: direct exchange - blocks for the P-1 others out, theirs in.
* ``allreduce``: ring (reduce-scatter then allgather) over P equal chunks - this
  rank sends and receives ``2 * (total - own chunk)`` bytes in ``2(P-1)`` messages.

At P = 1 every collective counts zero. What is counted adds up in a :class:`Traffic`.

Device buffers.  Where MPI can read and write device memory (an Open MPI built with CUDA:
``MPIX_Query_cuda_support()`` says so), a CUDA tensor's payload is handed to mpi4py as it is
(mpi4py takes it through DLPack or ``__cuda_array_interface__``), instead of crossing to the
host and back: :meth:`CountingComm.takes_device_buffer` decides, :func:`horovod_sparse.ops.host.to_wire`
hands it over, and the collectives allocate what they receive beside it.
``HOROVOD_SPARSE_DEVICE_BUFFERS`` (:data:`DEVICE_BUFFERS_CHOICES`) overrides the query: ``off``
never, ``on`` always, for an MPI whose CUDA support the query cannot see (one without
``MPIX_Query_cuda_support``) and for CPU tensors on the device path
(``HOROVOD_SPARSE_KERNELS=torch``), whose memory mpi4py then takes as it would a GPU's: how the
CPU runs this path.
"""
import ctypes
import functools
from dataclasses import dataclass, fields

import numpy as np
from mpi4py import MPI

from horovod_sparse import switches
from horovod_sparse.pipeline import ClosesOnExit

from horovod_sparse.errors import NonFiniteGradientError
from .validation import agree_call


@dataclass(frozen=True)
class Traffic:
    """What this rank sent and received, counted by :class:`CountingComm`.

    All fields are plain ints.  ``bytes_*`` include everything; ``control_bytes_*``
    are the part of them that is metadata (validation header, counts, threshold
    search), so ``payload_bytes_*`` is what carried (index, value) data.
    Traffics add and subtract field by field, e.g. ``after - before`` is one call.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    control_bytes_sent: int = 0
    control_bytes_received: int = 0

    def _combine(self, other, sign):
        if not isinstance(other, Traffic):
            return NotImplemented
        return Traffic(**{f.name: getattr(self, f.name) + sign * getattr(other, f.name)
                          for f in fields(self)})

    def __add__(self, other):
        return self._combine(other, +1)

    def __sub__(self, other):
        return self._combine(other, -1)

    @property
    def payload_bytes_sent(self) -> int:
        """Bytes sent that carried indices or values."""
        return self.bytes_sent - self.control_bytes_sent

    @property
    def payload_bytes_received(self) -> int:
        """Bytes received that carried indices or values."""
        return self.bytes_received - self.control_bytes_received

    @property
    def total_bytes(self) -> int:
        """bytes_sent + bytes_received."""
        return self.bytes_sent + self.bytes_received

    @property
    def payload_bytes(self) -> int:
        """payload_bytes_sent + payload_bytes_received."""
        return self.payload_bytes_sent + self.payload_bytes_received


#: the environment variable that chooses whether device buffers go to MPI as they are
#: (:mod:`horovod_sparse.switches`)
DEVICE_BUFFERS_ENV = switches.DEVICE_BUFFERS
#: "auto": CUDA tensors where MPI reports CUDA support; "on": every torch tensor that would
#: cross to the host; "off": none
DEVICE_BUFFERS_CHOICES = switches.CHOICES[DEVICE_BUFFERS_ENV]


def device_buffers_chosen():
    """The choice in force (one of :data:`DEVICE_BUFFERS_CHOICES`), read from the environment
    at each call; a value outside the choices reads as ``auto``, and the next exchange's
    agreement fails on every rank (:mod:`horovod_sparse.switches`)."""
    return switches.read(DEVICE_BUFFERS_ENV)


@functools.cache
def mpi_reports_cuda_support():
    """Whether the MPI library mpi4py loaded says it reads and writes CUDA memory
    (Open MPI's ``MPIX_Query_cuda_support()``, a runtime answer: a CUDA build run without
    CUDA says no). False where the library has no such query."""
    query = getattr(ctypes.CDLL(None), "MPIX_Query_cuda_support", None)  # mpi4py loaded libmpi globally
    if query is None:
        return False
    query.restype = ctypes.c_int
    return bool(query())


def cuda_payload_route():
    """How a CUDA tensor's payload reaches mpi4py, in words (for ``horovod-sparse doctor``)."""
    choice = device_buffers_chosen()
    if choice == "on" or (choice == "auto" and mpi_reports_cuda_support()):
        return f"handed to MPI as device buffers ({DEVICE_BUFFERS_ENV}={choice})"
    why = "this MPI reports no CUDA support" if choice == "auto" else f"{DEVICE_BUFFERS_ENV}=off"
    return f"through pinned host memory ({why})"


def _is_tensor(array):
    return not isinstance(array, np.ndarray) and hasattr(array, "__dlpack__")


def _mpi_buffer(array):
    """A contiguous buffer for MPI: a numpy array (mpi4py reads its datatype from the buffer
    protocol - the uppercase, zero-copy path; nothing is ever pickled), or a torch tensor
    handed over as it is (:meth:`CountingComm.takes_device_buffer`; mpi4py reads it through DLPack)."""
    return array if _is_tensor(array) else np.ascontiguousarray(array)


def _empty_like(array, n):
    """A 1-D receive buffer of ``n`` elements of ``array``'s dtype, beside it (a tensor's device)."""
    if _is_tensor(array):
        return array.new_empty(n)
    return np.empty(n, dtype=array.dtype)


class CountingComm(ClosesOnExit):
    """A ``Dup()`` of the user's communicator plus byte/message counters.

    Parameters
    ----------
    comm : mpi4py communicator
        Duplicated at construction (a collective call); only the duplicate is used,
        so our messages never match the user's. :meth:`close` frees it.
    """

    def __init__(self, comm):
        self._comm = comm.Dup()
        self.rank = self._comm.Get_rank()
        self.size = self._comm.Get_size()
        # [bytes_sent, bytes_received, messages_sent, messages_received,
        #  control_bytes_sent, control_bytes_received]
        self._counters = [0, 0, 0, 0, 0, 0]

    # ---------------------------------------------------------------- counting
    def _count(self, sent=0, received=0, messages_sent=0, messages_received=0, control=False):
        c = self._counters
        c[0] += int(sent)
        c[1] += int(received)
        c[2] += int(messages_sent)
        c[3] += int(messages_received)
        if control:
            c[4] += int(sent)
            c[5] += int(received)

    @property
    def traffic(self) -> Traffic:
        """Cumulative traffic since construction (a snapshot)."""
        return Traffic(*self._counters)

    @property
    def point_to_point(self) -> bool:
        """Whether the communicator carries point-to-point messages (not Horovod's collectives:
        :mod:`horovod_sparse.horovod_collectives`)."""
        return getattr(self._comm, "point_to_point", True)

    def takes_device_buffer(self, x):
        """Whether ``x`` (a torch tensor about to cross to the host for MPI) goes to MPI as it
        is instead: over MPI (not Horovod's collectives), CUDA tensors where MPI reports CUDA
        support, or as :data:`DEVICE_BUFFERS_ENV` says (module docstring)."""
        choice = device_buffers_chosen()
        if choice == "off" or not self.point_to_point:
            return False
        return choice == "on" or (x.is_cuda and mpi_reports_cuda_support())

    # ---------------------------------------------------------- point-to-point
    def isend(self, buf, dest, tag, control=False):
        """Non-blocking send of a contiguous numpy array; returns the MPI request."""
        self._count(sent=buf.nbytes, messages_sent=1, control=control)
        return self._comm.Isend(_mpi_buffer(buf), dest=dest, tag=tag)

    def irecv(self, buf, source, tag, control=False):
        """Non-blocking receive into a preallocated array of the exact expected size."""
        self._count(received=buf.nbytes, messages_received=1, control=control)
        return self._comm.Irecv(_mpi_buffer(buf), source=source, tag=tag)

    def send(self, buf, dest, tag, control=False):
        self._count(sent=buf.nbytes, messages_sent=1, control=control)
        self._comm.Send(_mpi_buffer(buf), dest=dest, tag=tag)

    def recv(self, buf, source, tag, control=False):
        self._count(received=buf.nbytes, messages_received=1, control=control)
        self._comm.Recv(_mpi_buffer(buf), source=source, tag=tag)

    def waitall(self, requests):
        """Wait for ``requests``; over Horovod's collectives, deliver every message posted since
        the last call (one alltoall: every rank calls this at the same points of an exchange)."""
        if not self.point_to_point:
            self._comm.Deliver_posted()
        elif requests:
            MPI.Request.Waitall(requests)

    # ------------------------------------------------------------- collectives
    def allgather(self, sendbuf, recvbuf, control=False):
        """Every rank's equal-size ``sendbuf`` into ``recvbuf`` (P blocks, rank order)."""
        peers = self.size - 1
        self._count(sendbuf.nbytes * peers, sendbuf.nbytes * peers, peers, peers, control)
        self._comm.Allgather(_mpi_buffer(sendbuf), _mpi_buffer(recvbuf))

    def allgatherv(self, sendbuf, counts, control=False):
        """Concatenate every rank's ``sendbuf`` (lengths ``counts``) in rank order.

        ``counts`` (elements per rank) must be known identically on all ranks.
        Returns the new array.
        """
        counts = [int(c) for c in counts]
        total = sum(counts)
        recvbuf = _empty_like(sendbuf, total)
        peers = self.size - 1
        own = sendbuf.nbytes
        self._count(own * peers, (total - counts[self.rank]) * sendbuf.itemsize,
                    peers, peers, control)
        displs = np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).tolist()
        self._comm.Allgatherv(_mpi_buffer(sendbuf), [recvbuf, (counts, displs)])
        return recvbuf

    def allgatherv_pairs(self, indices, values, counts, contiguous=True):
        """:meth:`allgatherv` of ``indices`` and of ``values`` (same length, ``counts[r]``
        pairs from rank r) as one Allgatherv of packed (index, value) records: one latency
        instead of two, the same bytes. Returns (indices, values) in rank order, contiguous,
        or (``contiguous=False``) as strided views of the received records, for a reader that
        takes them where they are (the compiled sum: two copies fewer).

        Example: ``all_i, all_v = comm.allgatherv_pairs(idx.astype(np.int32), vals, counts)``.
        """
        record = np.dtype([("i", indices.dtype), ("v", values.dtype)])  # packed: no padding
        if sum(int(c) for c in counts) * record.itemsize >= 2 ** 31:  # MPI's int byte displacements
            return (self.allgatherv(indices, counts),
                    self.allgatherv(np.ascontiguousarray(values), counts))
        mine = np.empty(len(indices), dtype=record)
        mine["i"], mine["v"] = indices, values
        counts = [int(c) * record.itemsize for c in counts]
        gathered = self.allgatherv(mine.view(np.uint8), counts).view(record)
        if not contiguous:
            return gathered["i"], gathered["v"]
        return np.ascontiguousarray(gathered["i"]), np.ascontiguousarray(gathered["v"])

    def alltoall(self, sendbuf, recvbuf, control=False):
        """One equal-size block to every rank (``sendbuf`` holds P blocks in rank order)."""
        peers = self.size - 1
        block = sendbuf.nbytes // max(self.size, 1)
        self._count(block * peers, block * peers, peers, peers, control)
        self._comm.Alltoall(_mpi_buffer(sendbuf), _mpi_buffer(recvbuf))

    def alltoallv(self, sendbuf, send_counts, recv_counts, control=False):
        """Blocks of different sizes to every rank (direct exchange model); returns ``recvbuf``.

        ``sendbuf`` holds P blocks in rank order, block r of ``send_counts[r]`` elements
        for rank r; the result holds P blocks in rank order, block r of
        ``recv_counts[r]`` elements from rank r (any dtype, the same on every rank).
        Counts are in elements and must match pairwise across ranks (what rank a sends
        to b is what b expects from a). Counted: the P-1 blocks to and from the peers
        (this rank's own block moves locally and is not counted), P-1 messages each way.
        Each count must be < 2**31 (MPI's int counts).
        """
        send_counts = [int(c) for c in send_counts]
        recv_counts = [int(c) for c in recv_counts]
        sendbuf = _mpi_buffer(sendbuf)
        recvbuf = _empty_like(sendbuf, sum(recv_counts))
        me, peers, item = self.rank, self.size - 1, sendbuf.itemsize
        self._count((sum(send_counts) - send_counts[me]) * item,
                    (sum(recv_counts) - recv_counts[me]) * item, peers, peers, control)
        send_displs = np.concatenate(([0], np.cumsum(send_counts[:-1], dtype=np.int64))).tolist()
        recv_displs = np.concatenate(([0], np.cumsum(recv_counts[:-1], dtype=np.int64))).tolist()
        self._comm.Alltoallv([sendbuf, (send_counts, send_displs)],
                             [recvbuf, (recv_counts, recv_displs)])
        return recvbuf

    def allreduce(self, sendbuf, recvbuf=None, op=MPI.SUM, control=False):
        """Element-wise reduction of ``sendbuf`` over ranks (ring model) into ``recvbuf`` where it
        lives as ``sendbuf`` does (both host arrays, or both tensors), else (None, or a host
        buffer for a device buffer handed over as it is) into a new buffer beside ``sendbuf``;
        returns it."""
        P = self.size
        nelem = sendbuf.nbytes // sendbuf.itemsize
        if recvbuf is None or _is_tensor(recvbuf) != _is_tensor(sendbuf):
            recvbuf = _empty_like(sendbuf, nelem)
        own_chunk = ((self.rank + 1) * nelem) // P - (self.rank * nelem) // P
        moved = 2 * (nelem - own_chunk) * sendbuf.itemsize if P > 1 else 0
        self._count(moved, moved, 2 * (P - 1), 2 * (P - 1), control)
        self._comm.Allreduce(_mpi_buffer(sendbuf), _mpi_buffer(recvbuf), op=op)
        return recvbuf

    # ----------------------------------------------------------------- closing
    def close(self):
        """Free the duplicated communicator (idempotent)."""
        if self._comm is not None and self._comm != MPI.COMM_NULL:
            self._comm.Free()
        self._comm = None

    @property
    def closed(self) -> bool:
        return self._comm is None


class CountedExchange(ClosesOnExit):
    """Base of the exchanges that run over their own :class:`CountingComm` (``self._comm``)
    and number their calls (``self._calls``, part of the agreement header): the sparse and
    the compressed allreduce.

    Example::

        call = self._next_call()  # first thing in a call; RuntimeError once closed
        agreed = self._agree(call, n=self.n, tag=tag, params=self._params_code, finite=finite)
    """

    _calls = 0

    @property
    def traffic(self):
        """Cumulative :class:`Traffic` of this exchange on this rank."""
        return self._comm.traffic

    @property
    def calls(self):
        """Number of calls made (the agreed call counter)."""
        return self._calls

    def _next_call(self):
        """This call's number, counted on every rank, also when the call is then rejected."""
        if self._comm.closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        self._calls += 1
        return self._calls - 1

    def _agree(self, call, **header):
        """:func:`~.validation.agree_call` on this exchange's communicator for call number
        ``call``. A call skipped for a non-finite gradient is not counted (every rank skips it):
        the next call runs as if it had not been made (its number seeds stochastic codes)."""
        try:
            return agree_call(self._comm, call=call, **header)
        except NonFiniteGradientError:
            self._calls = call
            raise

    def close(self):
        """Free the duplicated communicator (idempotent)."""
        self._comm.close()
