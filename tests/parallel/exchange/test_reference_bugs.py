"""One test per known bug of the Ok-Topk reference code showing we do not have it."""
from collections import defaultdict

import numpy as np
import pytest
from mpi4py import MPI

from exchange_helpers import (COMM, RANK, SIZE, all_ranks, close_to, dense_oracle,
                              identical_on_all_ranks, random_sparse)
from horovod_sparse.exchange import SparseAllreduce, intersect_sorted, mask_in_sorted


def sparse_oracle(indices, values):
    """Sum over ranks without densifying (for n beyond memory): {index: float64 sum}."""
    sums = defaultdict(float)
    for idx, val in COMM.allgather((indices.tolist(), values.astype(np.float64).tolist())):
        for i, v in zip(idx, val):
            sums[i] += v
    return sums


def test_residual_intersection_works_on_unsorted_local_indices():
    n, k = 1000, 40
    rng = np.random.default_rng(RANK)
    indices, values = random_sparse(n, k, seed=RANK)
    order = rng.permutation(indices.size)
    local_unsorted = indices[order]  # as a top-k selection returns them
    with SparseAllreduce(n, "oktopk", k=k) as ex:
        res = ex.allreduce(local_unsorted, values[order])
    mask = mask_in_sorted(local_unsorted, res.selected)
    assert all_ranks(np.array_equal(mask, np.isin(local_unsorted, res.selected)))
    both = intersect_sorted(indices, res.selected)
    assert all_ranks(np.array_equal(both, np.intersect1d(indices, res.selected)))
    with pytest.raises(ValueError, match="sorted"):
        intersect_sorted(local_unsorted if local_unsorted.size > 1 else np.array([2, 1]),
                         res.selected)


@pytest.mark.parametrize("algorithm", ["oktopk", "gtopk", "dsa", "allgather"])
def test_no_crash_when_a_rank_selects_nothing_across_repartitions(algorithm):
    n, k = 800, 30
    params = {"tau": 1, "tau_prime": 1} if algorithm == "oktopk" else {}
    with SparseAllreduce(n, algorithm, k=k, **params) as ex:
        for step in range(4):
            empty_rank = step % SIZE
            indices, values = random_sparse(n, k, seed=step * 10 + RANK)
            if RANK == empty_rank:
                indices, values = indices[:0], values[:0]
            res = ex.allreduce(indices, values)
            expected = dense_oracle(n, indices, values)
            assert all_ranks(close_to(res.values, expected[res.selected]))
    assert identical_on_all_ranks(res.indices, res.values)


@pytest.mark.parametrize("algorithm", ["oktopk", "gtopk", "dsa", "allgather", "dense"])
def test_no_crash_at_p_equal_1(algorithm):
    n, k = 300, 25
    with SparseAllreduce(n, algorithm, k=k, comm=MPI.COMM_SELF) as ex:
        for step in range(3):
            indices, values = random_sparse(n, 40, seed=step)
            res = ex.allreduce(indices, values)
            expected = np.zeros(n, np.float32)
            expected[indices] = values
            assert np.array_equal(res.dense()[res.selected], expected[res.selected])
        assert ex.traffic.total_bytes == 0


def test_cut_points_are_averaged_in_int64_beyond_2_pow_31():
    n = 2 ** 33 + 12345  # far beyond int32; only a few nonzeros, nothing dense is allocated
    k = 16
    rng = np.random.default_rng(RANK)
    indices = np.sort(rng.choice(2 ** 20, size=k, replace=False) + 2 ** 32 + 2 ** 31).astype(np.int64)
    values = rng.standard_normal(k).astype(np.float32)
    with SparseAllreduce(n, "oktopk", k=k) as ex:
        assert ex.index_dtype == np.int64
        res = ex.allreduce(indices, values)
        bounds = ex.state_dict()["oktopk_region_bounds"]
    # Expected bounds: the exact integer average of every rank's cut points.
    cuts = [indices[(j * k) // SIZE] for j in range(1, SIZE)]
    all_cuts = np.array(COMM.allgather([int(c) for c in cuts]), dtype=object).reshape(SIZE, -1)
    expected = [0] + [sum(int(c) for c in all_cuts[:, j]) // SIZE for j in range(SIZE - 1)] + [n]
    assert all_ranks(bounds.dtype == np.int64 and bounds.tolist() == expected)
    assert all_ranks(np.all(np.diff(bounds) >= 0) and (SIZE == 1 or bounds[1] > 2 ** 32))
    sums = sparse_oracle(indices, values)
    assert all_ranks(res.selected.size == min(k, len(sums)))
    assert all_ranks(set(res.selected.tolist()) <= set(sums))
    assert all_ranks(np.allclose(res.values, [sums[i] for i in res.selected.tolist()], rtol=1e-5))


@pytest.mark.parametrize("algorithm", ["oktopk", "gtopk", "dsa", "allgather"])
def test_indices_beyond_2_pow_24_survive_exactly(algorithm):
    # Odd integers above 2**24 are not representable in float32: packing indices
    # as float32 (as the reference code did) would move them.
    n = 2 ** 25 + 7
    k = 30
    rng = np.random.default_rng(RANK)
    indices = np.sort(2 ** 24 + 1 + 2 * rng.choice(2 ** 23, size=k, replace=False)).astype(np.int64)
    values = rng.standard_normal(k).astype(np.float32)
    assert np.any(indices.astype(np.float32).astype(np.int64) != indices)
    with SparseAllreduce(n, algorithm, k=k * SIZE) as ex:
        res = ex.allreduce(indices, values)
    sums = sparse_oracle(indices, values)
    assert all_ranks(res.indices.tolist() == sorted(sums))  # k*P >= union: everything selected
    assert all_ranks(np.allclose(res.values, [sums[i] for i in res.indices.tolist()], rtol=1e-5))


def test_gtopk_works_for_any_p_including_sub_communicators():
    # The world size itself (1..5 in CI) plus every sub-communicator size below it.
    n, k = 1000, 25
    for sub_size in range(1, SIZE + 1):
        color = 0 if RANK < sub_size else MPI.UNDEFINED
        sub = COMM.Split(color, RANK)
        if sub != MPI.COMM_NULL:
            indices, values = random_sparse(n, 40, seed=100 * sub_size + RANK)
            with SparseAllreduce(n, "gtopk", k=k, comm=sub) as ex:
                res = ex.allreduce(indices, values)
            local = np.zeros(n)
            local[indices] = values
            expected = np.empty(n)
            sub.Allreduce(local, expected)
            assert np.allclose(res.values, expected[res.selected], rtol=1e-5, atol=1e-6)
            assert res.selected.size == min(k, np.count_nonzero(expected))
            sub.Free()
        COMM.Barrier()


@pytest.mark.parametrize("algorithm", ["oktopk", "dsa", "gtopk", "allgather"])
def test_no_division_by_zero_when_n_smaller_than_p(algorithm):
    n = max(SIZE - 1, 1)  # some regions are empty whenever P > 1
    indices = np.arange(n, dtype=np.int64)
    values = np.full(n, float(RANK + 1), np.float32)
    with np.errstate(divide="raise", invalid="raise"):
        with SparseAllreduce(n, algorithm, k=n) as ex:
            for _ in range(3):
                res = ex.allreduce(indices, values)
    assert all_ranks(np.array_equal(res.selected, np.arange(n)))
    assert all_ranks(np.all(res.values == SIZE * (SIZE + 1) / 2))
