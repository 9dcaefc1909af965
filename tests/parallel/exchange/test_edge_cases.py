"""Edge cases: empty ranks, zeros, k >= n, n < P, P = 1, bad input on one rank, NaN, mismatches."""
import numpy as np
import pytest
from mpi4py import MPI

from exchange_helpers import (RANK, SIZE, all_ranks, close_to, dense_oracle,
                              identical_on_all_ranks, random_sparse)
from horovod_sparse.exchange import ALGORITHMS, ExchangeError, SparseAllreduce, Traffic

K = 20


def _check_against_oracle(algorithm, res, n, indices, values):
    expected = dense_oracle(n, indices, values)
    if algorithm in ("oktopk", "gtopk"):
        assert all_ranks(close_to(res.values, expected[res.selected]))
        support = int(np.count_nonzero(expected))
        assert all_ranks(res.selected.size <= int(1.2 * K))
        assert all_ranks(res.selected.size >= int(0.8 * min(K, support)))
    else:
        assert all_ranks(close_to(res.dense(), expected))
    assert identical_on_all_ranks(res.indices, res.values, res.selected)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_one_rank_selects_nothing(algorithm):
    n = 500
    indices, values = random_sparse(n, 30, seed=RANK)
    if RANK == SIZE - 1:
        indices, values = indices[:0], values[:0]
    with SparseAllreduce(n, algorithm, k=K, **({"tau": 2} if algorithm == "oktopk" else {})) as ex:
        for _ in range(3):
            res = ex.allreduce(indices, values)
            _check_against_oracle(algorithm, res, n, indices, values)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_ranks_empty(algorithm):
    n = 100
    with SparseAllreduce(n, algorithm, k=K) as ex:
        for _ in range(2):
            res = ex.allreduce(np.empty(0, np.int64), np.empty(0, np.float32))
            assert all_ranks(np.count_nonzero(res.dense()) == 0)
            if algorithm != "dense":
                assert all_ranks(res.indices.size == 0 and res.selected.size == 0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_all_zero_values(algorithm):
    n = 300
    indices, _ = random_sparse(n, 40, seed=RANK)
    values = np.zeros(indices.size, np.float32)
    with SparseAllreduce(n, algorithm, k=K) as ex:
        res = ex.allreduce(indices, values)
    assert all_ranks(np.count_nonzero(res.dense()) == 0)
    assert all_ranks(np.all(res.values == 0))
    if algorithm in ("oktopk", "gtopk"):  # zeros are still entries of the support
        assert all_ranks(res.selected.size == K)
    assert identical_on_all_ranks(res.indices, res.values)


@pytest.mark.parametrize("algorithm", ["oktopk", "gtopk"])
def test_k_at_least_n_selects_the_whole_support(algorithm):
    n = 50
    indices, values = random_sparse(n, 20, seed=RANK)
    with SparseAllreduce(n, algorithm, k=10 * n) as ex:
        res = ex.allreduce(indices, values)
    expected = dense_oracle(n, indices, values)
    union = np.unique(np.concatenate(MPI.COMM_WORLD.allgather(indices)))
    assert all_ranks(np.array_equal(res.selected, union))
    assert all_ranks(close_to(res.dense(), expected))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("n", [0, 1, 2])
def test_n_smaller_than_p(algorithm, n):
    indices = np.array([RANK % n], np.int64) if n else np.empty(0, np.int64)
    values = np.full(indices.size, RANK + 1.0, np.float32)
    with SparseAllreduce(n, algorithm, k=1) as ex:
        res = ex.allreduce(indices, values)
    expected = dense_oracle(n, indices, values)
    if algorithm in ("oktopk", "gtopk"):
        assert all_ranks(res.selected.size == min(1, n))
        assert all_ranks(close_to(res.values, expected[res.selected]))
    else:
        assert all_ranks(close_to(res.dense(), expected))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_single_rank_communicator(algorithm):
    # P = 1 regardless of how many ranks mpirun started.
    n = 200
    indices, values = random_sparse(n, 30, seed=RANK)
    with SparseAllreduce(n, algorithm, k=K, comm=MPI.COMM_SELF, average=True) as ex:
        for _ in range(3):
            res = ex.allreduce(indices, values)
        assert ex.traffic == Traffic()
    expected = np.zeros(n, np.float32)
    expected[indices] = values
    if algorithm in ("oktopk", "gtopk"):
        truth = np.sort(indices[np.argsort(-np.abs(values), kind="stable")[:K]])
        assert np.array_equal(res.selected, truth)
        assert np.array_equal(res.values, expected[truth])
    else:
        assert np.array_equal(res.dense(), expected)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("problem", ["duplicate", "out_of_range", "negative", "length", "dtype"])
def test_bad_input_on_one_rank_raises_everywhere_before_data_moves(algorithm, problem):
    n = 100
    indices, values = random_sparse(n, 10, seed=RANK)
    bad_rank = SIZE - 1
    if RANK == bad_rank:
        if problem == "duplicate":
            indices = indices.copy()
            indices[3] = indices[7]
        elif problem == "out_of_range":
            indices = np.append(indices[:-1], n)
        elif problem == "negative":
            indices = np.append(-1, indices[1:])
        elif problem == "length":
            values = values[:-1]
        else:
            values = values.astype(np.int32)
    with SparseAllreduce(n, algorithm, k=K) as ex:
        with pytest.raises(ExchangeError, match=f"rank {bad_rank}:") as info:
            ex.allreduce(indices, values)
        assert isinstance(info.value, ValueError)
        # Only the small agreement collective ran: no payload byte moved.
        assert all_ranks(ex.traffic.payload_bytes == 0)
        # The engine stays usable after the rejected call.
        good_indices, good_values = random_sparse(n, 10, seed=RANK)
        res = ex.allreduce(good_indices, good_values)
    assert identical_on_all_ranks(res.indices, res.values)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_nan_propagates_identically(algorithm):
    n = 400
    indices, values = random_sparse(n, 30, seed=RANK)
    nan_index = int(indices[0]) if RANK == 0 else None
    nan_index = MPI.COMM_WORLD.bcast(nan_index, root=0)
    if RANK == 0:
        values = values.copy()
        values[0] = np.nan
    with SparseAllreduce(n, algorithm, k=K) as ex:
        res = ex.allreduce(indices, values)
    assert identical_on_all_ranks(res.indices, res.values, res.selected)
    assert all_ranks(nan_index in res.selected.tolist())  # NaN has the largest magnitude
    assert all_ranks(np.isnan(res.dense()[nan_index]))
    finite = np.isfinite(res.values)
    assert all_ranks(finite.sum() == res.values.size - 1)


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to disagree")
@pytest.mark.parametrize("field", ["n", "algorithm", "k", "params", "value_dtype", "call"])
def test_mismatch_across_ranks_is_a_clear_error_everywhere(field):
    n, algorithm, k, params, dtype = 100, "allgather", None, {}, np.float32
    if field == "k":
        algorithm, k = "gtopk", 5 + (RANK == 1)
    if field == "params":
        algorithm, k, params = "oktopk", 5, {"tau": 8 + (RANK == 1)}
    if RANK == 1:
        n = 101 if field == "n" else n
        algorithm = "dsa" if field == "algorithm" else algorithm
        dtype = np.float64 if field == "value_dtype" else dtype
    indices, values = random_sparse(100, 10, seed=RANK, dtype=dtype)
    with SparseAllreduce(n, algorithm, k=k, **params) as ex:
        if field == "call" and RANK == 1:
            ex.load_state_dict(dict(ex.state_dict(), calls=7))
        with pytest.raises(ExchangeError, match=f"ranks disagree on {field}"):
            ex.allreduce(indices, values)


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to disagree")
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_different_tags_are_a_clear_error_everywhere(algorithm):
    n = 100
    indices, values = random_sparse(n, 10, seed=RANK)
    tags = [0xC0FFEE + (r == 1) for r in range(SIZE)]  # rank 1 has another gradient layout
    with SparseAllreduce(n, algorithm, k=K) as ex:
        with pytest.raises(ExchangeError, match=r"ranks disagree on tag \(rank 0: 12648430, "
                                                r"rank 1: 12648431") as info:
            ex.allreduce(indices, values, tag=tags[RANK])
        assert "before any data moved" in str(info.value)
        assert all_ranks(ex.traffic.payload_bytes == 0)
        # Equal tags (any int64, numpy ints included) pass, and the engine stays usable.
        res = ex.allreduce(indices, values, tag=np.int64(-2 ** 63))
        assert identical_on_all_ranks(res.indices, res.values)
        # A tag that is not an int64 on one rank is reported on every rank, naming it.
        bad = 2 ** 63 if RANK == SIZE - 1 else 0
        with pytest.raises(ExchangeError, match=f"rank {SIZE - 1}: tag must be an integer"):
            ex.allreduce(indices, values, tag=bad)
