"""Phase 1 of Ok-Topk (and the reduce of TopkDSA): split by region, reduce at the owner.

Each rank sends the part of its sparse vector that falls in region j to rank j
and sums what it receives for its own region.  Destination rotation: at step i
(1 <= i < P) a rank sends to rank+i and receives from rank-i, so at every step
all destinations are distinct and no rank is a hot spot.  Steps are grouped in
buckets of ``bucket_peers``; the next bucket's Isend/Irecv are posted before the
current bucket is summed, so summation overlaps the transfer.
"""
import numpy as np

from .sparse_ops import sum_duplicates

_TAG_INDICES, _TAG_VALUES = 101, 102
# Dense accumulation is used when the region is at most this many times larger
# than the number of entries arriving (memory stays O(entries), never O(n)).
_DENSE_FACTOR = 4
_DENSE_MIN = 1 << 16


class RegionAccumulator:
    """Sum of sparse pieces inside region [lo, hi), accumulated in float64.

    Dense (an array over the region plus a "touched" mask) when the region is
    small compared to the expected entries, else sorted-sparse merging.  Either
    way the sum is in the order pieces are added, so the owner's result is
    deterministic; it is then broadcast/allgathered, so all ranks see the same bits.
    """

    def __init__(self, lo, hi, expected_entries, value_dtype):
        self.lo, self.hi = int(lo), int(hi)
        self.value_dtype = np.dtype(value_dtype)
        self.dense = (self.hi - self.lo) <= max(_DENSE_MIN, _DENSE_FACTOR * expected_entries)
        if self.dense:
            self._sums = np.zeros(self.hi - self.lo, dtype=np.float64)
            self._touched = np.zeros(self.hi - self.lo, dtype=bool)
        else:
            self._indices = np.empty(0, np.int64)
            self._values = np.empty(0, np.float64)

    def add(self, pieces):
        """Add a list of (indices, values) pieces; each piece has unique indices in the region."""
        if self.dense:
            for indices, values in pieces:
                offsets = np.asarray(indices, dtype=np.int64) - self.lo
                self._sums[offsets] += values  # unique within a piece, so += is a scatter-add
                self._touched[offsets] = True
        elif pieces:
            self._indices, self._values = sum_duplicates(
                [self._indices] + [p[0] for p in pieces],
                [self._values] + [p[1] for p in pieces], np.float64)

    def result(self):
        """(sorted int64 indices of the touched support, sums in ``value_dtype``)."""
        if self.dense:
            offsets = np.flatnonzero(self._touched)
            return offsets + self.lo, self._sums[offsets].astype(self.value_dtype)
        return self._indices, self._values.astype(self.value_dtype)


def split_and_reduce(comm, indices, values, bounds, index_dtype, bucket_peers, codec=None,
                     encoded=None):
    """Reduce the sparse vectors of all ranks region by region.

    Parameters
    ----------
    comm : CountingComm
    indices, values : this rank's sparse vector, ``indices`` sorted ascending (int64).
        With a codec, ``values`` are this rank's values AS DECODED (float32), so the
        owner of a region sums the same floats whoever sent them.
    bounds : int64 array of P+1 region bounds (identical on all ranks).
    index_dtype : dtype of indices on the wire (int32 or int64).
    bucket_peers : number of rotation steps whose transfers are in flight together.
    codec : None, or the ValueCodec whose codes travel instead of the values.
    encoded : with a codec, a list of P uint8 arrays: ``encoded[j]`` is the code of
        this rank's values in region j (``codec.nbytes(count)`` bytes).

    Returns (indices, values) of the summed vector restricted to this rank's region.
    """
    size, rank = comm.size, comm.rank
    splits = np.searchsorted(indices, bounds)
    send_counts = np.diff(splits).astype(np.int64)
    recv_counts = np.empty(size, dtype=np.int64)
    comm.alltoall(send_counts, recv_counts, control=True)

    own = slice(splits[rank], splits[rank + 1])
    accumulator = RegionAccumulator(bounds[rank], bounds[rank + 1],
                                    int(recv_counts.sum()), values.dtype)
    accumulator.add([(indices[own], values[own])])

    send_requests, keep_alive = [], []

    def post(steps):
        """Post this bucket's sends and receives; return the receives to sum later."""
        receives, requests = [], []
        for step in steps:
            dest, source = (rank + step) % size, (rank - step) % size
            if send_counts[dest]:
                part = slice(splits[dest], splits[dest + 1])
                wire_indices = indices[part].astype(index_dtype)
                wire_values = (np.ascontiguousarray(values[part]) if codec is None
                               else np.ascontiguousarray(encoded[dest], dtype=np.uint8))
                keep_alive.extend((wire_indices, wire_values))
                send_requests.append(comm.isend(wire_indices, dest, _TAG_INDICES))
                send_requests.append(comm.isend(wire_values, dest, _TAG_VALUES))
            if recv_counts[source]:
                count = int(recv_counts[source])
                got_indices = np.empty(count, dtype=index_dtype)
                got_values = (np.empty(count, dtype=values.dtype) if codec is None
                              else np.empty(codec.nbytes(count), dtype=np.uint8))
                requests.append(comm.irecv(got_indices, source, _TAG_INDICES))
                requests.append(comm.irecv(got_values, source, _TAG_VALUES))
                receives.append((got_indices, got_values))
        return receives, requests

    def decoded(receives):
        """Received pieces with their values decoded (codes -> floats) when there is a codec."""
        if codec is None:
            return receives
        return [(i, codec.decode(v, i.size)) for i, v in receives]

    steps = list(range(1, size))
    buckets = [steps[i:i + bucket_peers] for i in range(0, len(steps), bucket_peers)]
    pending = post(buckets[0]) if buckets else None
    for b in range(len(buckets)):
        following = post(buckets[b + 1]) if b + 1 < len(buckets) else None
        receives, requests = pending
        comm.waitall(requests)
        accumulator.add(decoded(receives))  # overlaps with the transfers of `following`
        pending = following
    comm.waitall(send_requests)
    return accumulator.result()
