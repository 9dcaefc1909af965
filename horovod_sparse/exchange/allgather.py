"""TopkA: Allgatherv of every rank's (indices, values), then a local scatter-add.

Each rank sends its c entries to the P-1 others and receives theirs: with c = k
everywhere, 2k(P-1) (index, value) pairs sent + received per rank.  The counts
come from the validation header (no extra collective).  Every rank sums the
same concatenation in the same order, so the results are bitwise identical.
"""
import numpy as np

from .sparse_ops import sum_duplicates

DEFAULTS = {}


class Allgather:
    """TopkA exchange on a :class:`.comm.CountingComm`."""

    def __init__(self, comm, n, k, index_dtype):
        self.comm, self.index_dtype = comm, index_dtype
        self.counts = None  # per-rank entry counts of the current call, set by the engine

    def run(self, indices, values):
        counts = self.counts
        all_indices = self.comm.allgatherv(indices.astype(self.index_dtype), counts)
        all_values = self.comm.allgatherv(np.ascontiguousarray(values), counts)
        summed_indices, summed_values = sum_duplicates([all_indices], [all_values], values.dtype)
        return summed_indices, summed_values, summed_indices
