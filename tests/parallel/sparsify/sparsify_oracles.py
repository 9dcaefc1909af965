"""Independent oracles and checks of the sparsifier tests (numpy + mpi4py only, run under mpirun).

Nothing here calls the code under test except to read its outputs: the accumulated
vectors, selections and sums are recomputed from scratch.
"""
import math

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()
PAIR_BYTES = 4 + 4  # int32 index + float32 value on the wire (n < 2**31)
VALUE_BYTES = 4


def all_ranks(condition):
    """True on every rank iff ``condition`` holds on every rank (asserts then fail together)."""
    return bool(COMM.allreduce(bool(condition), op=MPI.LAND))


def gradient(n, step, rank, kind="normal", salt=0):
    """Float32 test gradient, different for every (step, rank, salt)."""
    rng = np.random.default_rng([salt, step, rank, 12345])
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32) * np.float32(1 + rank)
    if kind == "heavy":
        return rng.standard_t(2, n).astype(np.float32)
    raise ValueError(kind)


def brute_top_k(acc, k):
    """Sorted indices of the k largest |acc| (ties to the lower index; acc finite)."""
    order = np.lexsort((np.arange(acc.size), -np.abs(acc.astype(np.float64))))
    return np.sort(order[:k]).astype(np.int64)


def expected_accumulation(grad, residual, velocity=None, momentum=None):
    """acc = grad + residual; for DGC (u, v): u' = m*u + grad, acc = v + u'. Returns (acc, u')."""
    if momentum is None:
        return np.add(grad, residual, dtype=np.float32), None
    u = np.multiply(velocity, np.float32(momentum), dtype=np.float32) + grad
    return np.add(residual, u, dtype=np.float32), u


def densify(n, indices, values, dtype=np.float64):
    out = np.zeros(n, dtype=dtype)
    out[indices] = values
    return out


def rank_ordered_sum(n, indices, values):
    """Sum over ranks of the densified sparse vectors, in float64 in rank order (an
    Allgather of every rank's dense float32 vector, then a local sum)."""
    mine = densify(n, indices, values, np.float32)
    everyone = np.empty((SIZE, n), dtype=np.float32)
    COMM.Allgather(mine, everyone)
    total = np.zeros(n, dtype=np.float64)
    for r in range(SIZE):
        total += everyone[r].astype(np.float64)
    return total


def allreduce_sum(n, indices, values):
    """Sum over ranks of the densified sparse vectors, by an MPI Allreduce in float64."""
    local = densify(n, indices, values)
    total = np.empty_like(local)
    COMM.Allreduce(local, total, op=MPI.SUM)
    return total


def union_of(indices):
    return np.unique(np.concatenate(COMM.allgather(np.asarray(indices, np.int64))))


def bits(array):
    return np.ascontiguousarray(array).view(np.uint8)


def bitwise_equal(a, b):
    a, b = np.ascontiguousarray(a), np.ascontiguousarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(bits(a), bits(b))


def count_bounds(k):
    """The sparsify module's documented bound for estimated thresholds: [ceil(k/2), 2k]."""
    return math.ceil(k / 2), 2 * k


def on_every_rank(check, *args, **kwargs):
    """Run a local ``check``; if it fails on any rank, fail on EVERY rank with all messages.

    A plain assert failing on one rank would leave the others waiting in the test's
    next collective; this one small allgather keeps the ranks in step.
    """
    try:
        check(*args, **kwargs)
        error = ""
    except AssertionError as failure:
        error = f"rank {RANK}: {failure}".strip() or f"rank {RANK}: assertion failed"
        import traceback
        error += " at " + traceback.format_exc(limit=-1).strip().splitlines()[-2].strip()
    errors = [e for e in COMM.allgather(error) if e]
    assert not errors, " | ".join(errors)
