"""SparseAllreduce with a value codec (allgather, oktopk) against independent oracles.

The oracle re-does, with numpy and the test's own mpi4py calls, what the exchange must
compute: each rank's values as decoded (its own codec round trip, region by region for
Ok-Topk), their sum over ranks (an MPI Allreduce in float64, exact here because the
values span few binades), Ok-Topk's exact global top-k of that sum on the first call,
and the second rounding of the selected sums in the balanced pieces of phase 2. The
results must match bitwise on every rank, and the payload bytes must be exactly what
the code sizes imply.
"""
import numpy as np
import pytest
from mpi4py import MPI

from horovod_sparse.exchange import ExchangeError, SparseAllreduce
from horovod_sparse.quantize import Float32Codec
from horovod_sparse.quantize.rangefloat import RangeFloatCodec

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
N = 3000
INDEX_BYTES = 4  # int32 on the wire for n < 2**31
CODECS = [RangeFloatCodec(8), RangeFloatCodec(4, block_size=16), RangeFloatCodec(12, block_size=7),
          RangeFloatCodec(16, block_size=64)]


def rank_data(call, rank=RANK):
    """This rank's sparse vector of a call: 100..300 random indices (unsorted), values
    within 2**-4..2**4 (so float64 sums over ranks are exact in any order)."""
    rng = np.random.default_rng(1000 * call + rank)
    count = int(rng.integers(100, 300))
    indices = rng.choice(N, size=count, replace=False)
    values = (rng.choice([-1, 1], count) * 2.0 ** rng.uniform(-4, 4, count)).astype(np.float32)
    return indices, values


def sum_over_ranks(comm, indices, values):
    """Dense float64 sum over ranks of the sparse vectors, and the union support (sorted)."""
    dense = np.zeros(N)
    dense[indices] = values
    touched = np.zeros(N)
    touched[indices] = 1
    total, union = np.empty(N), np.empty(N)
    comm.Allreduce(dense, total)
    comm.Allreduce(touched, union)
    return total, np.flatnonzero(union)


def allgather_ints(comm, array):
    array = np.ascontiguousarray(array, dtype=np.int64)
    out = np.empty((comm.size, array.size), np.int64)
    comm.Allgather(array, out)
    return out


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_allgather_codec_matches_oracle(comm, assert_identical_across_ranks, codec):
    with SparseAllreduce(N, "allgather", value_codec=codec) as ex:
        for call in range(3):
            indices, values = rank_data(call)
            res = ex.allreduce(indices, values)
            order = np.argsort(indices)
            decoded = codec.roundtrip(values[order])
            assert np.array_equal(res.sent_indices, indices[order])
            assert np.array_equal(res.sent_values.view(np.uint32), decoded.view(np.uint32))
            total, union = sum_over_ranks(comm, indices[order], decoded)
            assert np.array_equal(res.indices, union)
            assert np.array_equal(res.values.view(np.uint32), total[union].astype(np.float32).view(np.uint32))
            assert_identical_across_ranks(res.values)
            # payload: indices (int32) + codes, allgathered to the P-1 others
            counts = allgather_ints(comm, [indices.size])[:, 0]
            piece = [c * INDEX_BYTES + codec.nbytes(c) for c in counts]
            assert res.traffic.payload_bytes_sent == (SIZE - 1) * piece[RANK]
            assert res.traffic.payload_bytes_received == sum(piece) - piece[RANK]


def balanced_pieces(counts):
    """(lo, hi) global positions of each phase-2 code piece (holder h -> balanced owner q)."""
    total = int(counts.sum())
    held = np.concatenate(([0], np.cumsum(counts)))
    target = [(q * total) // SIZE for q in range(SIZE + 1)]
    pieces = {}
    for q in range(SIZE):
        for h in range(SIZE):
            lo, hi = max(held[h], target[q]), min(held[h + 1], target[q + 1])
            if hi > lo:
                pieces[(h, q)] = (int(lo), int(hi))
    return pieces, target


@pytest.mark.parametrize("codec", CODECS, ids=repr)
def test_oktopk_codec_matches_oracle(comm, assert_identical_across_ranks, codec):
    k = 200
    with SparseAllreduce(N, "oktopk", k=k, value_codec=codec, tau=2, tau_prime=2) as ex:
        for call in range(4):
            indices, values = rank_data(call)
            res = ex.allreduce(indices, values)
            bounds = np.asarray(ex.state_dict()["oktopk_region_bounds"])  # the bounds this call used
            order = np.argsort(indices)
            sorted_indices, sorted_values = indices[order], values[order]
            splits = np.searchsorted(sorted_indices, bounds)
            decoded = np.concatenate([codec.roundtrip(sorted_values[splits[j]:splits[j + 1]])
                                      for j in range(SIZE)])
            assert np.array_equal(res.sent_values.view(np.uint32), decoded.view(np.uint32))
            total, union = sum_over_ranks(comm, sorted_indices, decoded)
            sums = total.astype(np.float32)
            selected = res.selected
            assert np.array_equal(selected, res.indices)
            if call % 2 == 0:  # exact global selection (tau_prime = 2): top-k of |sum|
                assert selected.size == min(k, union.size)
                rest = np.setdiff1d(union, selected)
                if rest.size:
                    assert np.abs(sums[selected]).min() >= np.abs(sums[rest]).max()
            # phase 2: each balanced piece of the selected sums encoded once
            counts = np.diff(np.searchsorted(selected, bounds))
            pieces, target = balanced_pieces(counts)
            expected = np.empty(selected.size, np.float32)
            for lo, hi in pieces.values():
                expected[lo:hi] = codec.roundtrip(sums[selected][lo:hi])
            assert np.array_equal(res.values.view(np.uint32), expected.view(np.uint32))
            assert_identical_across_ranks(res.values)
            # payload, exactly: phase 1 (per destination), balance moves, Allgatherv
            region_counts = allgather_ints(comm, np.diff(splits))  # [sender, region]
            sent = sum(c * INDEX_BYTES + codec.nbytes(c) for j, c in enumerate(region_counts[RANK])
                       if j != RANK and c)
            received = sum(c * INDEX_BYTES + codec.nbytes(c) for s, c in enumerate(region_counts[:, RANK])
                           if s != RANK and c)
            owner_bytes = [sum(codec.nbytes(hi - lo) for (h, q), (lo, hi) in pieces.items() if q == p)
                           for p in range(SIZE)]
            owner_count = np.diff(target)
            for (h, q), (lo, hi) in pieces.items():
                if h != q and h == RANK:
                    sent += (hi - lo) * INDEX_BYTES + codec.nbytes(hi - lo)
                if h != q and q == RANK:
                    received += (hi - lo) * INDEX_BYTES + codec.nbytes(hi - lo)
            piece = [owner_count[p] * INDEX_BYTES + owner_bytes[p] for p in range(SIZE)]
            if selected.size:
                sent += (SIZE - 1) * piece[RANK]
                received += sum(piece) - piece[RANK]
            assert res.traffic.payload_bytes_sent == sent
            assert res.traffic.payload_bytes_received == received


@pytest.mark.parametrize("algorithm", ["allgather", "oktopk"])
def test_float32_codec_gives_the_same_results_as_no_codec(assert_identical_across_ranks, algorithm):
    k = 150 if algorithm == "oktopk" else None
    with SparseAllreduce(N, algorithm, k=k, value_codec=Float32Codec()) as coded, \
            SparseAllreduce(N, algorithm, k=k) as plain:
        for call in range(3):
            indices, values = rank_data(call)
            a, b = coded.allreduce(indices, values), plain.allreduce(indices, values)
            assert np.array_equal(a.indices, b.indices) and np.array_equal(a.selected, b.selected)
            assert np.array_equal(a.values.view(np.uint32), b.values.view(np.uint32))
            # Same bytes; the uncoded path packs (index, value) pairs into one message where
            # the coded one sends indices and codes apart, so only the message counts differ.
            for field in ("bytes_sent", "bytes_received", "control_bytes_sent", "control_bytes_received"):
                assert getattr(a.traffic, field) == getattr(b.traffic, field), field
            assert_identical_across_ranks(a.values)


def test_different_codecs_raise_on_every_rank():
    codec = RangeFloatCodec(8) if RANK == 0 else RangeFloatCodec(16)
    with SparseAllreduce(N, "allgather", value_codec=codec) as ex:
        indices, values = rank_data(0)
        if SIZE == 1:
            ex.allreduce(indices, values)
            return
        with pytest.raises(ExchangeError, match="params"):
            ex.allreduce(indices, values)


def test_codec_with_no_entries_anywhere(assert_identical_across_ranks):
    codec = RangeFloatCodec(8)
    for algorithm, k in (("allgather", None), ("oktopk", 10)):
        with SparseAllreduce(N, algorithm, k=k, value_codec=codec) as ex:
            res = ex.allreduce(np.empty(0, np.int64), np.empty(0, np.float32))
            assert res.indices.size == 0 and res.values.size == 0
            res = ex.allreduce(np.array([RANK]), np.array([1.5], np.float32))  # then one each
            assert np.array_equal(res.dense()[:SIZE], np.full(SIZE, 1.5, np.float32))
            assert_identical_across_ranks(res.values)


@pytest.mark.parametrize("algorithm", ["dense", "gtopk", "dsa"])
def test_value_codec_rejected_for_other_algorithms(algorithm):
    with pytest.raises(ValueError, match="value_codec"):
        SparseAllreduce(N, algorithm, k=10, value_codec=RangeFloatCodec(8))


def test_value_codec_must_be_a_sum_codec():
    class Vote(Float32Codec):
        aggregate = "majority"
    with pytest.raises(ValueError, match="value_codec"):
        SparseAllreduce(N, "allgather", value_codec=Vote())
    with pytest.raises(ValueError, match="value_codec"):
        SparseAllreduce(N, "allgather", value_codec="rangefloat")
