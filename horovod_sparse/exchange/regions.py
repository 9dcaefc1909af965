"""Region bounds: which contiguous index range [bounds[j], bounds[j+1]) rank j owns.

All arithmetic is in int64 (the reference code averaged cut points in int32 and
overflowed past 2**31), and nothing divides by the region size, so n < P
(empty regions) is fine.
"""
import numpy as np
from mpi4py import MPI


def equal_region_bounds(n, size):
    """P+1 int64 bounds cutting [0, n) into ``size`` near-equal ranges (some may be empty)."""
    return np.array([(j * n) // size for j in range(size + 1)], dtype=np.int64)


def local_cut_points(sorted_indices, size):
    """The P-1 indices at which this rank's sorted selection splits into P equal-count pieces."""
    count = sorted_indices.size
    positions = [(j * count) // size for j in range(1, size)]
    return np.asarray(sorted_indices[positions], dtype=np.int64)


def repartition(comm, sorted_indices, n):
    """Ok-Topk space repartition: average the ranks' cut points (int64, one Allreduce).

    Ranks that selected nothing have no cut points and are left out of the
    average (the reference code crashed on them); if no rank selected anything
    the regions are equal.  Averages of non-decreasing sequences are
    non-decreasing, so the bounds are valid ranges.
    """
    size = comm.size
    if size == 1:
        return np.array([0, n], dtype=np.int64)
    contribution = np.zeros(size, dtype=np.int64)  # P-1 cut points + "I contributed" flag
    if sorted_indices.size:
        contribution[:-1] = local_cut_points(sorted_indices, size)
        contribution[-1] = 1
    total = np.empty_like(contribution)
    comm.allreduce(contribution, total, op=MPI.SUM, control=True)
    contributors = int(total[-1])
    if contributors == 0:
        return equal_region_bounds(n, size)
    cuts = total[:-1] // contributors
    return np.concatenate(([0], cuts, [n])).astype(np.int64)
