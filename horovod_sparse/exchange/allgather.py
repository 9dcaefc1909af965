"""TopkA: Allgatherv of every rank's (indices, values), then a local scatter-add.

Each rank sends its c entries to the P-1 others and receives theirs: with c = k
everywhere, 2k(P-1) (index, value) pairs sent + received per rank.  The counts
come from the validation header (no extra collective).  Every rank sums the
same concatenation in the same order, so the results are bitwise identical.

With a value codec (:class:`horovod_sparse.quantize.ValueCodec`) each rank encodes
its values once (``codec.nbytes(c)`` bytes), the byte strings are allgathered
and every rank decodes every piece, its own included, before the sum: all ranks
sum the same decoded floats.
"""
import numpy as np

from .seeds import derive_seed
from .sparse_ops import sum_duplicates

DEFAULTS = {}


class Allgather:
    """TopkA exchange on a :class:`.comm.CountingComm`.

    ``codec`` (a ValueCodec or None) and ``seed`` (int, the call's base seed for
    stochastic codecs) are set by the engine; after :meth:`run`, ``decoded_own`` holds
    this rank's values as every receiver decodes them (None without a codec).
    """

    codec = None
    seed = 0

    def __init__(self, comm, n, k, index_dtype):
        self.comm, self.index_dtype = comm, index_dtype
        self.counts = None  # per-rank entry counts of the current call, set by the engine
        self.decoded_own = None

    def run(self, indices, values):
        counts = self.counts
        if self.codec is None:
            # the sum reads the received records where they are (strided views, no unpacking copies)
            all_indices, all_values = self.comm.allgatherv_pairs(indices.astype(self.index_dtype), values, counts,
                                                                 contiguous=False)
            summed_indices, summed_values = sum_duplicates([all_indices], [all_values], values.dtype)
            return summed_indices, summed_values, summed_indices
        all_indices = self.comm.allgatherv(indices.astype(self.index_dtype), counts)
        codec, rank = self.codec, self.comm.rank
        mine = codec.encode(values, derive_seed(self.seed, rank, 0))
        byte_counts = [codec.nbytes(c) for c in counts]
        all_bytes = self.comm.allgatherv(mine, byte_counts)
        offsets = np.concatenate(([0], np.cumsum(byte_counts))).astype(np.int64)
        pieces = [codec.decode(all_bytes[offsets[r]:offsets[r + 1]], int(counts[r]))
                  for r in range(len(byte_counts))]
        self.decoded_own = pieces[rank]
        all_values = np.concatenate(pieces) if pieces else np.empty(0, np.float32)
        summed_indices, summed_values = sum_duplicates([all_indices], [all_values], np.float32)
        return summed_indices, summed_values, summed_indices
