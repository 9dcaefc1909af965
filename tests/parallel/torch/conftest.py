import horovod.torch as hvd
import pytest
import torch
from mpi4py import MPI

_SIZE = MPI.COMM_WORLD.Get_size()
#: two process sets, all ranks but the last and the last one (test_training_scripts.py):
#: Horovod needs its process sets at init unless it runs with dynamic ones
PROCESS_SETS = [hvd.ProcessSet(list(range(_SIZE - 1))), hvd.ProcessSet([_SIZE - 1])] if _SIZE > 1 else []


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init(process_sets=PROCESS_SETS)
    torch.manual_seed(0)
    yield hvd


@pytest.fixture(scope="session")
def process_sets(horovod):
    """The process sets made at init, each with its ranks: ``[ranks 0..P-2, rank P-1]``."""
    return PROCESS_SETS
