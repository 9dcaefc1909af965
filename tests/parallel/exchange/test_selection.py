"""The exact global selection picks the same entries whichever way it finds the threshold."""
import numpy as np
import pytest
from mpi4py import MPI

from horovod_sparse.exchange import selection
from horovod_sparse.exchange.comm import CountingComm


@pytest.fixture
def counting_comm():
    comm = CountingComm(MPI.COMM_WORLD)
    yield comm
    comm.close()


@pytest.mark.parametrize("target", [1, 7, 50, 400])
@pytest.mark.parametrize("with_ties", [False, True])
def test_gather_and_radix_select_the_same_entries(counting_comm, monkeypatch, target, with_ties):
    rng = np.random.default_rng(40 + counting_comm.rank)
    keys = rng.integers(0, 50 if with_ties else 2**31, size=100 + 10 * counting_comm.rank).astype(np.uint32)
    target = min(target, int(MPI.COMM_WORLD.allreduce(keys.size)))
    results = {}
    for path in (True, False):
        monkeypatch.setattr(selection, "_gather_is_cheaper", lambda *args, path=path: path)
        results[path] = selection.exact_select(counting_comm, keys.copy(), target)
    (mask_gather, t_gather), (mask_radix, t_radix) = results[True], results[False]
    assert t_gather == t_radix
    np.testing.assert_array_equal(mask_gather, mask_radix)
    assert MPI.COMM_WORLD.allreduce(int(mask_gather.sum())) == target


def test_small_targets_gather_large_targets_use_radix():
    counts = np.array([10_000, 10_000, 10_000, 10_000])
    assert selection._gather_is_cheaper(counts, 95, 4, 4)          # ~1.1 KB instead of ~12 KB
    assert not selection._gather_is_cheaper(counts, 5_000, 4, 4)   # 60 KB: radix wins
