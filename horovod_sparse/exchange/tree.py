"""Binomial-tree reduce and broadcast over point-to-point messages, for any P.

Reduce: ranks >= P2 (P2 = largest power of two <= P) first fold into rank - P2,
as in recursive-halving algorithms, then a binomial tree over ranks 0..P2-1
ends at rank 0.  Broadcast: a binomial tree from rank 0 over all P ranks.
The combine order is fixed by the tree, so the root's result depends only on
the inputs; it is then broadcast, so every rank ends with the same bits.
"""
import numpy as np

_TAG_COUNT, _TAG_INDICES, _TAG_VALUES = 301, 302, 303


def reduce_to_root(comm, payload, send, receive, combine):
    """Fold + binomial reduction of ``payload`` to rank 0.

    ``send(payload, dest)`` and ``receive(source)`` move one payload;
    ``combine(mine, theirs)`` merges them.  Returns the root's final payload on
    rank 0 and None elsewhere.
    """
    size, rank = comm.size, comm.rank
    power = 1 << (size.bit_length() - 1)
    if rank >= power:
        send(payload, rank - power)
        return None
    if rank + power < size:
        payload = combine(payload, receive(rank + power))
    distance = 1
    while distance < power:
        if rank % (2 * distance) == distance:
            send(payload, rank - distance)
            return None
        payload = combine(payload, receive(rank + distance))
        distance *= 2
    return payload


def fold_like_the_tree(payloads, combine):
    """What :func:`reduce_to_root` leaves at rank 0, computed on one rank from every rank's
    ``payloads`` (a list in rank order): the same ``combine(mine, theirs)`` calls in the same
    order, so the same bits. For a transport without point-to-point messages, where every
    rank gathers the payloads and folds them alike."""
    payloads = list(payloads)
    size = len(payloads)
    power = 1 << (size.bit_length() - 1)
    for rank in range(power, size):           # the extra ranks fold in first
        payloads[rank - power] = combine(payloads[rank - power], payloads[rank])
    distance = 1
    while distance < power:                   # then the binomial tree over 0..power-1
        for rank in range(0, power, 2 * distance):
            payloads[rank] = combine(payloads[rank], payloads[rank + distance])
        distance *= 2
    return payloads[0]


def broadcast_from_root(comm, array, length, dtype, tag, control=False):
    """Binomial broadcast of a 1-D array of known ``length`` from rank 0; returns it."""
    size, rank = comm.size, comm.rank
    if rank != 0:
        array = np.empty(length, dtype=dtype)
        parent = rank - (1 << (rank.bit_length() - 1))
        comm.recv(array, parent, tag, control=control)
    step = 1 << rank.bit_length() if rank else 1
    requests = []
    while rank + step < size:
        requests.append(comm.isend(array, rank + step, tag, control=control))
        step *= 2
    comm.waitall(requests)
    return array


def broadcast_indices(comm, indices, index_dtype):
    """Broadcast a variable-length int64 index array from rank 0 (its length first, as control)."""
    length = np.array([0 if indices is None else indices.size], dtype=np.int64)
    length = broadcast_from_root(comm, length, 1, np.int64, _TAG_COUNT, control=True)
    wire = None if comm.rank else np.asarray(indices).astype(index_dtype)
    wire = broadcast_from_root(comm, wire, int(length[0]), index_dtype, _TAG_INDICES)
    return wire.astype(np.int64)


def broadcast_values(comm, values, length, value_dtype):
    """Broadcast a value array of known length from rank 0."""
    return broadcast_from_root(comm, values, length, value_dtype, _TAG_VALUES)


def sparse_messenger(comm, index_dtype, value_dtype):
    """(send, receive) moving a variable-length sparse (indices, values) payload."""
    def send(payload, dest):
        indices, values = payload
        comm.send(np.array([indices.size], dtype=np.int64), dest, _TAG_COUNT, control=True)
        comm.send(np.asarray(indices).astype(index_dtype), dest, _TAG_INDICES)
        comm.send(np.ascontiguousarray(values), dest, _TAG_VALUES)

    def receive(source):
        count = np.empty(1, dtype=np.int64)
        comm.recv(count, source, _TAG_COUNT, control=True)
        indices = np.empty(int(count[0]), dtype=index_dtype)
        values = np.empty(int(count[0]), dtype=value_dtype)
        comm.recv(indices, source, _TAG_INDICES)
        comm.recv(values, source, _TAG_VALUES)
        return indices.astype(np.int64), values

    return send, receive


def dense_messenger(comm, length, value_dtype):
    """(send, receive) moving a value array of known ``length``."""
    def send(values, dest):
        comm.send(np.ascontiguousarray(values), dest, _TAG_VALUES)

    def receive(source):
        values = np.empty(length, dtype=value_dtype)
        comm.recv(values, source, _TAG_VALUES)
        return values

    return send, receive
