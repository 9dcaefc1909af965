"""Independent oracles of the compressed allreduce, shared by the quantize tests.

They take every rank's input (gathered by the test's own mpi4py Allgather) and redo,
in one process with plain numpy and the codec's encode/decode, what the documented
exchange computes: the seeds of the module docstring of
horovod_sparse.exchange.compressed, rank-order float32 sums from the first piece, the majority
vote, the owners' re-encoding and their server residuals.
"""
import numpy as np
from mpi4py import MPI

from horovod_sparse.exchange.seeds import derive_seed

COMM = MPI.COMM_WORLD
RANK, SIZE = COMM.rank, COMM.size


def gather_rows(comm, x):
    """(P, n) float32: every rank's 1-D float32 ``x``, in rank order (mpi4py Allgather)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows = np.empty((comm.size, x.size), np.float32)
    comm.Allgather(x, rows)
    return rows


def vote(total):
    return np.where(total >= 0, np.float32(1), np.float32(-1)).astype(np.float32)


def sum_in_rank_order(pieces, count):
    total = np.array(pieces[0], dtype=np.float32) if pieces else np.zeros(count, np.float32)
    for piece in pieces[1:]:
        total += piece
    return total


def chunk_bounds(n, size, unit):
    """The documented chunks: rank j's starts at (j * (n // unit) // size) * unit."""
    return [0] + [(j * (n // unit) // size) * unit for j in range(1, size)] + [n]


class ExchangeOracle:
    """The exchange's result for inputs (P, n); keeps the owners' server residuals."""

    def __init__(self, n, codec, method, size, server_error_feedback=False):
        self.n, self.codec, self.method, self.size = n, codec, method, size
        self.majority = codec.aggregate == "majority"
        self.bounds = chunk_bounds(n, size, getattr(codec, "chunk_unit", 1))
        self.server = ([np.zeros(self.bounds[j + 1] - self.bounds[j], np.float32) for j in range(size)]
                       if server_error_feedback else None)

    def own(self, x, rank, seed):
        """What rank ``rank`` contributes, as decoded."""
        if self.method == "allgather":
            return self.codec.roundtrip(x, derive_seed(seed, rank))
        b = self.bounds
        return np.concatenate([self.codec.roundtrip(x[b[j]:b[j + 1]], derive_seed(seed, rank, j))
                               for j in range(self.size)])

    def __call__(self, inputs, seed):
        P, codec = self.size, self.codec
        if self.method == "allgather":
            total = sum_in_rank_order([self.own(inputs[r], r, seed) for r in range(P)], self.n)
            return vote(total) * np.float32(P) if self.majority else total
        out = []
        for j in range(P):
            lo, hi = self.bounds[j], self.bounds[j + 1]
            total = sum_in_rank_order([codec.roundtrip(inputs[r][lo:hi], derive_seed(seed, r, j))
                                       for r in range(P)], hi - lo)
            if self.majority:
                total = vote(total)
            if P <= 2:  # documented: no owners' re-encoding at P = 1 and 2 (the sum is quantized once)
                out.append(total)
                continue
            if self.server is not None:
                total = total + self.server[j]
            decoded = codec.roundtrip(total, derive_seed(seed, P + j, j))
            if self.server is not None:
                self.server[j] = total - decoded
            out.append(decoded)
        out = np.concatenate(out)
        return out * np.float32(P) if self.majority else out


def payload_bytes_sent(codec, method, n, size, rank):
    """The documented exact payload bytes a rank sends per call."""
    if method == "allgather":
        return (size - 1) * codec.nbytes(n)
    b = chunk_bounds(n, size, getattr(codec, "chunk_unit", 1))
    chunk = [b[j + 1] - b[j] for j in range(size)]
    return sum(codec.nbytes(chunk[j]) for j in range(size) if j != rank) + (size - 1) * codec.nbytes(chunk[rank])
