"""Shared helpers of the exchange tests (imported by the test modules, run under mpirun)."""
import hashlib

import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()
F32_RTOL = 1e-5


def random_sparse(n, count, seed, dtype=np.float32):
    """Sorted unique indices in [0, n) and normal values, different per seed."""
    rng = np.random.default_rng(seed)
    count = min(count, n)
    indices = np.sort(rng.choice(n, size=count, replace=False)).astype(np.int64)
    return indices, rng.standard_normal(count).astype(dtype)


def dense_oracle(n, indices, values, average=False):
    """Independent oracle: float64 MPI Allreduce of each rank's densified input."""
    local = np.zeros(n, dtype=np.float64)
    local[indices] = values
    total = np.empty_like(local)
    COMM.Allreduce(local, total, op=MPI.SUM)
    return total / SIZE if average else total


def all_ranks(condition):
    """True on every rank iff ``condition`` holds on every rank (so asserts fail together)."""
    return bool(COMM.allreduce(bool(condition), op=MPI.LAND))


def identical_on_all_ranks(*arrays):
    """True iff the given arrays have the same bytes (and dtypes/shapes) on every rank."""
    digest = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        digest.update(str((a.dtype, a.shape)).encode())
        digest.update(a.tobytes())
    mine = np.frombuffer(digest.digest(), dtype=np.uint8).copy()
    everyone = np.empty((SIZE, mine.size), dtype=np.uint8)
    COMM.Allgather(mine, everyone)
    return bool(np.all(everyone == everyone[0]))


def close_to(result_values, expected, size=SIZE):
    """float32 summation tolerance (NaN-aware)."""
    return np.allclose(result_values, expected, rtol=F32_RTOL, atol=1e-6 * size, equal_nan=True)
