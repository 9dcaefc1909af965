"""TopkDSA (SparCML-style): static regions, reduce at the owner, sparse-or-dense allgather.

1. Region j = [j*n//P, (j+1)*n//P) belongs to rank j (static, equal length).
2. Reduce each region at its owner (:func:`.split_reduce.split_and_reduce`).
3. An owner switches its region to dense once the sparse form would be larger:
   count * (index bytes + value bytes) > region length * value bytes.
4. One Allgather of (mode, length) per rank, then Allgatherv of the sparse
   regions' indices and of all regions' values.

In a dense region the result contains every index of the region (zeros included).
"""
import numpy as np

from .regions import equal_region_bounds
from .split_reduce import split_and_reduce

DEFAULTS = dict(bucket_peers=4)


class DSA:
    """TopkDSA exchange on a :class:`.comm.CountingComm`.

    bucket_peers : rotation steps in flight together in the reduce (default 4).
    """

    def __init__(self, comm, n, k, index_dtype, bucket_peers):
        if isinstance(bucket_peers, bool) or not isinstance(bucket_peers, (int, np.integer)) \
                or bucket_peers < 1:
            raise ValueError(f"bucket_peers must be an integer >= 1, got {bucket_peers!r}")
        self.comm, self.n, self.index_dtype = comm, n, np.dtype(index_dtype)
        self.bucket_peers = int(bucket_peers)
        self.region_bounds = equal_region_bounds(n, comm.size)

    def run(self, indices, values):
        comm, bounds = self.comm, self.region_bounds
        region_indices, region_values = split_and_reduce(
            comm, indices, values, bounds, self.index_dtype, self.bucket_peers)
        lo, hi = int(bounds[comm.rank]), int(bounds[comm.rank + 1])
        value_bytes = values.dtype.itemsize
        go_dense = region_indices.size * (self.index_dtype.itemsize + value_bytes) \
            > (hi - lo) * value_bytes
        if go_dense:
            send_indices = np.empty(0, self.index_dtype)
            send_values = np.zeros(hi - lo, dtype=values.dtype)
            send_values[region_indices - lo] = region_values
        else:
            send_indices = region_indices.astype(self.index_dtype)
            send_values = region_values

        layout = np.empty((comm.size, 2), dtype=np.int64)  # per rank: dense?, value count
        comm.allgather(np.array([go_dense, send_values.size], dtype=np.int64), layout, control=True)
        dense_region, value_counts = layout[:, 0].astype(bool), layout[:, 1]
        index_counts = np.where(dense_region, 0, value_counts)
        all_indices = comm.allgatherv(send_indices, index_counts)
        all_values = comm.allgatherv(np.ascontiguousarray(send_values), value_counts)

        # Rebuild the index list region by region (regions are ordered, so it is sorted).
        pieces, start = [], 0
        for j in range(comm.size):
            if dense_region[j]:
                pieces.append(np.arange(bounds[j], bounds[j + 1], dtype=np.int64))
            else:
                pieces.append(all_indices[start:start + index_counts[j]].astype(np.int64))
                start += int(index_counts[j])
        result_indices = np.concatenate(pieces) if pieces else np.empty(0, np.int64)
        return result_indices, all_values, result_indices
