"""Single-process tests of the exchange engine's local pieces and parameter checks."""
import numpy as np
import pytest
from mpi4py import MPI

from horovod_sparse.exchange import (ALGORITHMS, ExchangeError, SparseAllreduce, Traffic,
                                     intersect_sorted, mask_in_sorted)
from horovod_sparse.exchange.sparse_ops import (magnitude_keys, sum_duplicates,
                                                top_k_by_magnitude, wire_index_dtype)
from horovod_sparse.exchange.validation import LocalInput


def test_traffic_adds_and_subtracts_fieldwise():
    a = Traffic(1, 2, 3, 4, 1, 0)
    b = Traffic(10, 20, 30, 40, 5, 6)
    assert a + b == Traffic(11, 22, 33, 44, 6, 6)
    assert (a + b) - a == b
    assert b.payload_bytes_sent == 5 and b.payload_bytes_received == 14 and b.total_bytes == 30


def test_wire_index_dtype_switches_at_2_pow_31():
    assert wire_index_dtype(2 ** 31 - 1) == np.int32
    assert wire_index_dtype(2 ** 31) == np.int64


def test_magnitude_keys_order_like_abs_with_nan_largest():
    v = np.array([-3.0, 0.5, np.inf, -0.0, np.nan, 2.0, -np.inf], np.float32)
    order = np.argsort(magnitude_keys(v), kind="stable")
    assert v[order[:4]].tolist()[:3] == [-0.0, 0.5, 2.0]
    assert np.isnan(v[order[-1]])
    assert np.all(np.isinf(v[order[-3:-1]]))


def test_sum_duplicates_and_top_k_tie_break():
    idx, val = sum_duplicates([np.array([5, 1]), np.array([1, 9])],
                              [np.array([1.0, 2.0]), np.array([3.0, -4.0])], np.float32)
    assert idx.tolist() == [1, 5, 9] and val.tolist() == [5.0, 1.0, -4.0]
    top_i, top_v = top_k_by_magnitude(np.array([1, 2, 3, 4]), np.array([1.0, -2.0, 2.0, 0.5]), 2)
    assert top_i.tolist() == [2, 3] and top_v.tolist() == [-2.0, 2.0]
    top_i, _ = top_k_by_magnitude(np.array([1, 2, 3]), np.array([1.0, 1.0, 1.0]), 2)
    assert top_i.tolist() == [1, 2]  # ties: smaller index first


def test_intersection_helpers():
    local_unsorted = np.array([9, 1, 7, 3, 12])
    selected = np.array([1, 3, 5, 12])
    assert mask_in_sorted(local_unsorted, selected).tolist() == [False, True, False, True, True]
    assert intersect_sorted(np.sort(local_unsorted), selected).tolist() == [1, 3, 12]
    with pytest.raises(ValueError, match="sorted"):
        intersect_sorted(local_unsorted, selected)
    with pytest.raises(ValueError, match="sorted"):
        mask_in_sorted(local_unsorted, selected[::-1])
    assert mask_in_sorted(np.empty(0, np.int64), selected).size == 0


@pytest.mark.parametrize("indices, values, code", [
    (np.array([1, 2, 2]), np.ones(3, np.float32), 5),
    (np.array([1, 10]), np.ones(2, np.float32), 4),
    (np.array([-1, 2]), np.ones(2, np.float32), 4),
    (np.array([1, 2]), np.ones(3, np.float32), 3),
    (np.array([1.0, 2.0]), np.ones(2, np.float32), 1),
    (np.array([1, 2]), np.ones(2, np.int64), 2),
    (np.array([[1, 2]]), np.ones(2, np.float32), 1),
])
def test_local_input_errors_become_codes_not_exceptions(indices, values, code):
    assert LocalInput(indices, values, 10).error_code == code


def test_local_input_sorts_without_copy_when_already_sorted():
    idx = np.array([1, 4, 7], np.int64)
    val = np.array([1.0, 2.0, 3.0], np.float32)
    local = LocalInput(idx, val, 10)
    assert local.error_code == 0 and np.shares_memory(local.indices, idx)
    local = LocalInput(idx[::-1], val[::-1], 10)
    assert local.indices.tolist() == [1, 4, 7] and local.values.tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("kwargs, name", [
    (dict(n=-1), "n"), (dict(n=2.5), "n"), (dict(algorithm="foo"), "algorithm"),
    (dict(algorithm="oktopk"), "k"), (dict(algorithm="gtopk", k=0), "k"),
    (dict(algorithm="oktopk", k=5, tau=0), "tau"),
    (dict(algorithm="oktopk", k=5, tau_prime=-2), "tau_prime"),
    (dict(algorithm="oktopk", k=5, selection_slack=1.5), "selection_slack"),
    (dict(algorithm="oktopk", k=5, threshold_nudge=0.9), "threshold_nudge"),
    (dict(algorithm="dsa", bucket_peers=0), "bucket_peers"),
    (dict(algorithm="dense", tau=3), "tau"), (dict(average="yes"), "average"),
])
def test_bad_parameters_raise_value_error_naming_them(kwargs, name):
    kwargs = dict(dict(n=10, algorithm="allgather", comm=MPI.COMM_SELF), **kwargs)
    with pytest.raises(ValueError, match=name):
        SparseAllreduce(**kwargs)


def test_single_process_engine_and_error_type():
    assert ALGORITHMS == ("dense", "allgather", "oktopk", "gtopk", "dsa")
    assert issubclass(ExchangeError, ValueError)
    with SparseAllreduce(10, "oktopk", k=2, comm=MPI.COMM_SELF) as ex:
        res = ex.allreduce(np.array([7, 2, 5]), np.array([1.0, -3.0, 2.0], np.float32))
        assert res.selected.tolist() == [2, 5] and res.values.tolist() == [-3.0, 2.0]
        with pytest.raises(ExchangeError, match="rank 0: index 3 appears more than once"):
            ex.allreduce(np.array([3, 3]), np.ones(2, np.float32))
