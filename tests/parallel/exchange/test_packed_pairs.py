"""CountingComm.allgatherv_pairs: one Allgatherv of packed (index, value) records gives
exactly what two Allgathervs give, bit for bit, and counts the same bytes."""
import numpy as np
import pytest
from mpi4py import MPI

from exchange_helpers import RANK, SIZE, all_ranks
from horovod_sparse.exchange.comm import CountingComm


@pytest.mark.parametrize("index_dtype,value_dtype", [(np.int32, np.float32), (np.int64, np.float64),
                                                     (np.int32, np.float64), (np.int64, np.float32)])
def test_packed_pairs_equal_two_allgathervs_bitwise(index_dtype, value_dtype):
    comm = CountingComm(MPI.COMM_WORLD)
    try:
        counts = [3 * r + r % 2 for r in range(SIZE)]  # unequal, rank 0 sends nothing
        rng = np.random.default_rng(RANK)
        indices = rng.integers(0, 10**6, counts[RANK]).astype(index_dtype)
        values = rng.standard_normal(counts[RANK]).astype(value_dtype)
        values[:1] = np.nan  # any bit pattern survives the packing
        before = comm.traffic
        packed_indices, packed_values = comm.allgatherv_pairs(indices, values, counts)
        packed_traffic = comm.traffic - before
        before = comm.traffic
        two_indices = comm.allgatherv(indices, counts)
        two_values = comm.allgatherv(values, counts)
        two_traffic = comm.traffic - before
        assert all_ranks(packed_indices.dtype == index_dtype and packed_values.dtype == value_dtype)
        assert all_ranks(np.array_equal(packed_indices, two_indices))
        assert all_ranks(packed_values.tobytes() == two_values.tobytes())
        assert all_ranks(packed_values.flags.c_contiguous and packed_indices.flags.c_contiguous)
        assert all_ranks(packed_traffic.bytes_sent == two_traffic.bytes_sent
                         and packed_traffic.bytes_received == two_traffic.bytes_received)
        assert all_ranks(packed_traffic.messages_sent * 2 == two_traffic.messages_sent)
        # as strided views of the received records: the same numbers, nothing unpacked
        view_indices, view_values = comm.allgatherv_pairs(indices, values, counts, contiguous=False)
        assert all_ranks(np.array_equal(view_indices, two_indices) and view_values.tobytes() == two_values.tobytes())
        assert all_ranks(view_indices.base is not None and view_indices.base is view_values.base
                         or not view_indices.size)
    finally:
        comm.close()


def test_packed_pairs_with_nothing_anywhere():
    comm = CountingComm(MPI.COMM_WORLD)
    try:
        got = comm.allgatherv_pairs(np.empty(0, np.int32), np.empty(0, np.float32), [0] * SIZE)
        assert all_ranks(got[0].size == 0 and got[1].size == 0 and got[1].dtype == np.float32)
    finally:
        comm.close()
