"""Dense baseline: densify locally, one MPI Allreduce of n values (2n(P-1)/P per rank, ring).

Bitwise identity across ranks relies on MPI returning the same reduction result
on every rank, which Open MPI's allreduce algorithms do (the MPI standard
recommends it); the tests check it.
"""
import numpy as np
from mpi4py import MPI

DEFAULTS = {}


class Dense:
    """Dense allreduce on a :class:`.comm.CountingComm`; returns a dense vector."""

    def __init__(self, comm, n, k, index_dtype):
        self.comm, self.n = comm, n

    def run(self, indices, values):
        local = np.zeros(self.n, dtype=values.dtype)
        local[indices] = values
        summed = np.empty_like(local)
        self.comm.allreduce(local, summed, op=MPI.SUM)
        return None, summed, None
