"""The environment switches (horovod_sparse/switches.py): read at each use, a value outside the
choices read as the default there, and refused by the exchange's agreement, before any data
moves (the same at P > 1 on every rank: tests/parallel/torch/test_horovod_habits.py)."""
import numpy as np
import pytest
from mpi4py import MPI

from horovod_sparse import switches
from horovod_sparse.errors import ExchangeError
from horovod_sparse.exchange import SparseAllreduce


@pytest.fixture(autouse=True)
def unset(monkeypatch):
    for variable in switches.CHOICES:
        monkeypatch.delenv(variable, raising=False)


def test_each_switch_reads_its_default_unless_set_to_one_of_its_choices(monkeypatch):
    assert [switches.read(v) for v in switches.CHOICES] == ["numba", "auto"]
    assert switches.problem_here() is None and switches.first_invalid() == -1
    monkeypatch.setenv(switches.DEVICE_BUFFERS, " Off ")
    assert switches.read(switches.DEVICE_BUFFERS) == "off" and switches.first_invalid() == -1
    monkeypatch.setenv(switches.DEVICE_BUFFERS, "cuda")
    assert switches.read(switches.DEVICE_BUFFERS) == "auto"
    assert switches.problem_here() == \
        "HOROVOD_SPARSE_DEVICE_BUFFERS must be one of ['auto', 'on', 'off'], got 'cuda'"
    assert switches.first_invalid() == 1
    assert switches.invalid_text(1) == "HOROVOD_SPARSE_DEVICE_BUFFERS is set to none of ['auto', 'on', 'off']"
    monkeypatch.setenv(switches.KERNELS, "fast")
    assert switches.first_invalid() == 0 and switches.problem_here().count("must be one of") == 2


def test_an_exchange_refuses_an_invalid_switch_before_any_data_moves_and_goes_on_once_it_is_mended(monkeypatch):
    with SparseAllreduce(10, "oktopk", k=2, comm=MPI.COMM_SELF) as ex:
        before = ex.state_dict()
        monkeypatch.setenv(switches.KERNELS, "fast")
        with pytest.raises(ExchangeError, match=r"call 0 rejected on every rank before any data moved: "
                                                r"rank 0: HOROVOD_SPARSE_KERNELS is set to none of "
                                                r"\['numba', 'numpy', 'torch'\]"):
            ex.allreduce(np.array([7, 2, 5]), np.array([1.0, -3.0, 2.0], np.float32))
        # Ok-Topk's thresholds as they were; only the call counter moved, as on every rank
        after = ex.state_dict()
        assert after.pop("calls") == before.pop("calls") + 1
        assert after.keys() == before.keys() and all(np.array_equal(after[k], before[k]) for k in after)
        monkeypatch.setenv(switches.KERNELS, "numpy")
        res = ex.allreduce(np.array([7, 2, 5]), np.array([1.0, -3.0, 2.0], np.float32))
        assert res.selected.tolist() == [2, 5] and res.values.tolist() == [-3.0, 2.0]
