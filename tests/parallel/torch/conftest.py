import horovod.torch as hvd
import pytest
import torch
from mpi4py import MPI

from world_sizes import mark_unmarked

_SIZE = MPI.COMM_WORLD.Get_size()
#: two process sets, all ranks but the last and the last one (test_training_scripts.py):
#: Horovod needs its process sets at init unless it runs with dynamic ones
PROCESS_SETS = [hvd.ProcessSet(list(range(_SIZE - 1))), hvd.ProcessSet([_SIZE - 1])] if _SIZE > 1 else []


@pytest.hookimpl(tryfirst=True)  # before tests/parallel/conftest.py deselects by world_sizes
def pytest_collection_modifyitems(config, items):
    """The frontend over the exchanges that tests/parallel/exchange, sparsify and quantize check at
    P = 1-5 and 2-4: its tests run at 2 unless a module asks for other counts. The modules whose
    subject changes with the count ask for 3 too (an odd count: the oracles of the sparsifiers and
    quantizers, checkpoints' per-rank state, process sets, one rank of three differing); the
    demo's convergence runs at 4, its setting."""
    mark_unmarked(items, 2)


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init(process_sets=PROCESS_SETS)
    torch.manual_seed(0)
    yield hvd


@pytest.fixture(scope="session")
def process_sets(horovod):
    """The process sets made at init, each with its ranks: ``[ranks 0..P-2, rank P-1]``."""
    return PROCESS_SETS
