"""A communicator that exchanges over Horovod's own collectives instead of MPI.

Under ``horovodrun --gloo`` (and elastic, Spark, Ray launches) mpi4py's world is each
process alone, but Horovod's collectives run among all of Horovod's ranks.
:class:`HorovodCollectives` offers the part of mpi4py's ``Comm`` that the package's
out-of-band exchanges use (buffer-based, uppercase calls on host numpy arrays) and carries
each call with one Horovod collective of the frontend in use, within the communicator's
Horovod process set: ``horovod.torch`` on a ``torch.from_numpy`` view of the buffer, or
``horovod.tensorflow`` on a ``tf.constant`` of it, run eagerly (lifted out of any trace; the
TensorFlow frontend's exchanges run inside ``tf.numpy_function`` calls of the traced step,
where Horovod's eager collectives run beside the step's own pending allreduces). The two
differ only there (:class:`_TorchCollectives`, :class:`_TensorFlowCollectives`).

- Horovod matches operations across ranks by name: every call gets the name
  ``<prefix>.<call number>``, so the same program order on every rank gives the same names.
  ``Dup()`` is a new prefix (``<prefix>.<dup number>``) and no collective.
- Buffers only, never pickled objects. Every buffer moves as its bytes (``uint8``), so any
  dtype travels, structured ones included; ``Allreduce`` reduces float16/32/64 and
  int32/64 natively and other integer types through int64.
- No point-to-point messages: Horovod has none. ``Isend`` and ``Irecv`` are posted, and every
  message posted since the last delivery moves in one ``alltoall`` at :meth:`Deliver_posted`
  (what :meth:`horovod_sparse.exchange.comm.CountingComm.waitall` calls here), which every rank
  calls at the same points of its exchange, as Ok-Topk's and TopkDSA's do: a rank's messages to
  one peer arrive in the order posted, into the receives that peer posted in the same order.
  Blocking ``Send`` and ``Recv`` raise (gTop-k's tree runs from its inputs gathered instead).
- One thread at a time: the call counter is the order of calls.

Example::

    import horovod.torch as hvd
    hvd.init()                                    # horovodrun --gloo -np 2 ...
    comm = HorovodCollectives(hvd)
    every = np.empty((comm.Get_size(), 2), np.int64)
    comm.Allgather(np.array([comm.Get_rank(), 7]), every)   # [[0, 7], [1, 7]] on every rank
"""
import numpy as np

#: what :attr:`HorovodCollectives.transport` says
TRANSPORT = "Horovod's collectives"
#: dtypes Horovod's allreduce reduces as they are
_REDUCED_AS_IS = (np.float16, np.float32, np.float64, np.int32, np.int64)


class HorovodCollectives:
    """mpi4py's ``Comm`` calls of the package, carried by Horovod's collectives.

    Args:
        hvd: the initialised ``horovod.torch`` or ``horovod.tensorflow`` module.
        process_set: the Horovod process set (None: all of Horovod's ranks); ranks are the set's.
        reason: why this transport runs (the doctor prints it), e.g. ``"gloo launch"``.
        prefix: the root of the operations' names (the same on every rank).
    """

    #: Isend/Irecv only posted, delivered together by Deliver_posted (module docstring)
    point_to_point = False
    transport = TRANSPORT

    def __init__(self, hvd, process_set=None, reason="", prefix=None):
        self._hvd = hvd
        self._framework = _FRAMEWORKS[hvd.__name__](hvd)
        self._set = hvd.global_process_set if process_set is None else process_set
        self._ranks = list(range(hvd.size())) if process_set is None else [int(r) for r in process_set.ranks]
        self.rank = hvd.rank() if process_set is None else self._set.rank()
        self.size = len(self._ranks)
        self.reason = reason
        self._prefix = f"horovod_sparse.{self._set.process_set_id}" if prefix is None else prefix
        self._calls = self._dups = 0
        self._freed = False
        # messages posted since the last Deliver_posted: (peer, array), in the order posted
        self._posted_sends, self._posted_receives = [], []

    def __repr__(self):
        return f"HorovodCollectives(rank {self.rank} of {self.size}, {self._prefix!r})"

    # -------------------------------------------------------------- mpi4py's Comm
    def Get_size(self):
        return self.size

    def Get_rank(self):
        return self.rank

    def Dup(self):
        """A communicator of the same ranks whose operations never match this one's."""
        self._dups += 1
        return HorovodCollectives(self._hvd, None if self._set is self._hvd.global_process_set else self._set,
                                  self.reason, f"{self._prefix}.{self._dups}")

    def Free(self):
        self._freed = True

    def Barrier(self):
        self._allreduce(np.zeros(1, np.int32), self._hvd.Sum)

    def Bcast(self, buf, root=0):
        data = _bytes_of(buf)
        if data.size:  # the same size on every rank, as in MPI
            _write(buf, self._framework.broadcast(data, self._ranks[root], name=self._name(), process_set=self._set))

    def Allgather(self, sendbuf, recvbuf):
        data = _bytes_of(sendbuf)
        if data.size:
            _write(recvbuf, self._allgather(data))

    def Allgatherv(self, sendbuf, recvbuf):
        """``recvbuf``: ``(buf, counts)`` or ``[buf, (counts, displs)]``, in elements of ``buf``."""
        buf, counts, displs = _spec(recvbuf)
        if sum(counts):  # counts are the same on every rank
            _place(buf, self._allgather(_bytes_of(sendbuf)), counts, displs)

    def Allreduce(self, sendbuf, recvbuf, op=None):
        """``op``: mpi4py's ``MPI.SUM`` (the default), ``MAX``, ``MIN`` or ``PROD``."""
        send = np.ascontiguousarray(sendbuf)
        if send.dtype.type in _REDUCED_AS_IS:
            result = self._allreduce(send.reshape(-1), self._op(op))
        elif send.dtype.kind in "biu" and send.dtype.itemsize < 8:
            result = self._allreduce(send.reshape(-1).astype(np.int64), self._op(op))
        else:
            raise TypeError(f"HorovodCollectives.Allreduce: Horovod reduces no {send.dtype}")
        recv = np.asarray(recvbuf)
        recv[...] = result.reshape(recv.shape)  # back to its dtype (int64 -> int8 ...)

    def Alltoall(self, sendbuf, recvbuf):
        data = _bytes_of(sendbuf)
        block = data.size // self.size
        _write(recvbuf, self._alltoall(data, [block] * self.size))

    def Alltoallv(self, sendbuf, recvbuf):
        """Both ``[buf, (counts, displs)]`` (or ``(buf, counts)``), in elements of their buffers."""
        send, send_counts, send_displs = _spec(sendbuf)
        recv, recv_counts, recv_displs = _spec(recvbuf)
        item = np.asarray(send).dtype.itemsize
        packed = _packed_bytes(send, send_counts, send_displs)
        _place(recv, self._alltoall(packed, [c * item for c in send_counts]), recv_counts, recv_displs)

    def Gatherv(self, sendbuf, recvbuf, root=0):
        """``recvbuf`` at ``root``: ``(buf, counts)``; elsewhere ignored (None)."""
        data = _bytes_of(sendbuf)
        received = self._alltoall(data, [data.size if r == root else 0 for r in range(self.size)])
        if self.rank == root:
            buf, counts, displs = _spec(recvbuf)
            _place(buf, received, counts, displs)

    def Scatterv(self, sendbuf, recvbuf, root=0):
        """``sendbuf`` at ``root``: ``(buf, counts)``; elsewhere ignored (None)."""
        if self.rank == root:
            buf, counts, displs = _spec(sendbuf)
            item = np.asarray(buf).dtype.itemsize
            data, splits = _packed_bytes(buf, counts, displs), [c * item for c in counts]
        else:
            data, splits = np.empty(0, np.uint8), [0] * self.size
        _write(recvbuf, self._alltoall(data, splits))

    def Isend(self, buf, dest, tag=0):
        """Posted: it moves at the next :meth:`Deliver_posted` (``buf`` unchanged until then, as
        MPI asks of a pending send). Returns no request."""
        self._posted_sends.append((int(dest), np.asarray(buf)))

    def Irecv(self, buf, source, tag=0):
        """Posted: ``buf`` is filled at the next :meth:`Deliver_posted`. Returns no request."""
        self._posted_receives.append((int(source), buf))

    def Deliver_posted(self):
        """Every message posted since the last call, in one ``alltoall`` (collective: every rank
        calls it at the same points, with or without messages of its own)."""
        sends, receives = self._posted_sends, self._posted_receives
        self._posted_sends, self._posted_receives = [], []
        by_peer = [[_bytes_of(data) for peer, data in sends if peer == p] for p in range(self.size)]
        splits = [sum(piece.size for piece in pieces) for pieces in by_peer]
        pieces = [piece for pieces in by_peer for piece in pieces]
        received = self._alltoall(np.concatenate(pieces) if pieces else np.empty(0, np.uint8), splits)
        expected = [sum(np.asarray(buf).nbytes for peer, buf in receives if peer == p) for p in range(self.size)]
        if received.size != sum(expected):
            raise RuntimeError(f"HorovodCollectives: {received.size} bytes of posted messages arrived, the posted "
                               f"receives expect {sum(expected)}: the ranks posted messages that do not match")
        start = np.concatenate(([0], np.cumsum(expected)))[:-1].tolist()  # each source's bytes, in rank order
        for source, buf in receives:
            size = np.asarray(buf).nbytes
            _write(buf, received[start[source]:start[source] + size])
            start[source] += size

    def Send(self, *args, **kwargs):
        raise NotImplementedError(_NO_POINT_TO_POINT)

    Recv = Send

    # ------------------------------------------------------------------- Horovod
    def _name(self):
        if self._freed:
            raise RuntimeError(f"{self!r} was freed")
        self._calls += 1
        return f"{self._prefix}.{self._calls}"

    def _allreduce(self, data, op):
        return self._framework.allreduce(data, op, name=self._name(), process_set=self._set)

    def _allgather(self, data):
        return self._framework.allgather(data, name=self._name(), process_set=self._set)

    def _alltoall(self, data, splits):
        return self._framework.alltoall(data, splits, name=self._name(), process_set=self._set)

    def _op(self, op):
        from mpi4py import MPI  # the ops are mpi4py's, as the callers pass them
        hvd = self._hvd
        for mpi_op, ours in ((MPI.SUM, hvd.Sum), (MPI.MAX, hvd.Max), (MPI.MIN, hvd.Min), (MPI.PROD, hvd.Product)):
            if op is None or op == mpi_op:
                return ours
        raise ValueError(f"HorovodCollectives.Allreduce: no Horovod reduction for {op!r}")


class _TorchCollectives:
    """``horovod.torch``'s collectives on numpy arrays (``torch.from_numpy`` views, no copy)."""

    def __init__(self, hvd):
        import torch  # late: the module is importable without torch
        self._hvd, self._torch = hvd, torch

    def allreduce(self, array, op, **where):
        return self._run(self._hvd.allreduce_async(self._tensor(array), op=op, **where))

    def allgather(self, array, **where):
        return self._run(self._hvd.allgather_async(self._tensor(array), **where))

    def broadcast(self, array, root_rank, **where):
        return self._run(self._hvd.broadcast_async(self._tensor(array), root_rank, **where))

    def alltoall(self, array, splits, **where):
        splits = self._torch.tensor(splits, dtype=self._torch.int32)
        return self._run(self._hvd.alltoall_async(self._tensor(array), splits, **where))

    def _tensor(self, array):
        if not array.flags.writeable:  # torch.from_numpy warns on read-only memory
            array = array.copy()
        return self._torch.from_numpy(array)

    def _run(self, handle):
        result = self._hvd.synchronize(handle)
        return (result[0] if isinstance(result, tuple) else result).numpy()  # alltoall: (output, splits)


class _TensorFlowCollectives:
    """``horovod.tensorflow``'s collectives on numpy arrays, run eagerly: lifted out of a trace
    (the agreement at a step's first ``compress`` runs while it is traced), and inside the
    traced step's ``tf.numpy_function`` calls, where TensorFlow executes eagerly."""

    def __init__(self, hvd):
        import tensorflow as tf  # late: the module is importable without TensorFlow
        self._hvd, self._tf = hvd, tf

    def allreduce(self, array, op, **where):
        return self._run(self._hvd.allreduce, array, op=op, **where).numpy()

    def allgather(self, array, **where):
        return self._run(self._hvd.allgather, array, **where).numpy()

    def broadcast(self, array, root_rank, **where):
        return self._run(self._hvd.broadcast, array, root_rank, **where).numpy()

    def alltoall(self, array, splits, **where):
        output, _ = self._run(self._hvd.alltoall, array, self._tf.constant(splits, self._tf.int32), **where)
        return output.numpy()

    def _run(self, collective, array, *args, **where):
        with self._tf.init_scope():
            if not self._tf.executing_eagerly():
                from horovod_sparse.errors import HorovodWorldError
                raise HorovodWorldError(
                    "Horovod's collectives carry TensorFlow's exchanges only where TensorFlow executes eagerly "
                    "(tf.function and Keras do); a TF1-style graph run by a Session exchanges over mpi4py: "
                    "launch through MPI (horovodrun without --gloo, or mpirun)")
            return collective(self._tf.constant(array), *args, ignore_name_scope=True, **where)


#: the frontend module's name -> its collectives on numpy arrays
_FRAMEWORKS = {"horovod.torch": _TorchCollectives, "horovod.tensorflow": _TensorFlowCollectives}

_NO_POINT_TO_POINT = ("Horovod's collectives carry no blocking point-to-point messages (Send/Recv), only "
                      "posted ones (Isend/Irecv, delivered together by Deliver_posted)")


def _spec(spec):
    """``(buf, counts)`` or ``[buf, (counts, displs)]`` -> ``(buf, counts, displs)`` (ints,
    elements of ``buf``; displs packed one after the other where not given)."""
    buf, layout = spec[0], spec[1]
    if len(layout) == 2 and not np.isscalar(layout[0]):
        counts, displs = layout
    else:
        counts, displs = layout, None
    counts = [int(c) for c in counts]
    if displs is None:
        displs = np.concatenate([[0], np.cumsum(counts[:-1], dtype=np.int64)]).tolist() if counts else []
    return buf, counts, [int(d) for d in displs]


def _bytes_of(array):
    """A contiguous array's bytes, flat (no copy where it is contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def _write(buf, data):
    """``data`` (bytes) into the array ``buf``, in place."""
    target = np.asarray(buf)
    if target.flags.c_contiguous:
        target.reshape(-1).view(np.uint8)[...] = data
    else:
        target[...] = data.view(target.dtype).reshape(target.shape)


def _packed_bytes(buf, counts, displs):
    """The blocks of ``buf`` at ``displs`` (``counts`` elements each), one after the other, as bytes."""
    flat = np.ascontiguousarray(buf).reshape(-1)
    if displs == np.concatenate([[0], np.cumsum(counts[:-1], dtype=np.int64)]).tolist()[:len(counts)]:
        return flat[:sum(counts)].view(np.uint8)
    return np.concatenate([flat[d:d + c] for c, d in zip(counts, displs)]).view(np.uint8)


def _place(buf, data, counts, displs):
    """Received blocks (bytes, one after the other, ``counts`` elements each) into ``buf`` at ``displs``."""
    target = np.asarray(buf)
    if not target.flags.c_contiguous:
        raise ValueError("HorovodCollectives: a receive buffer with displacements must be contiguous")
    target = target.reshape(-1)
    values = data.view(target.dtype)
    start = 0
    for count, displ in zip(counts, displs):
        target[displ:displ + count] = values[start:start + count]
        start += count
