"""The frontends under ``horovodrun --gloo`` (scripts/run_tests.py launches this group with
horovodrun, not mpirun, one launch per module: Horovod runs one frontend per process, and each
module initialises its own): Horovod's ranks are Gloo's, mpi4py's world is each process alone,
and the out-of-band exchanges run over Horovod's own collectives
(:mod:`horovod_sparse.horovod_collectives`).

mpi4py's world has one process on every rank, so tests/parallel/conftest.py's failure sync
over mpi4py sees one rank; the run's outcome merges every rank's JUnit file. Its selection by
``world_sizes`` reads Horovod's size (``HOROVOD_SIZE``): a test whose subject does not change
with the number of ranks (a refusal) is marked ``world_sizes(3)``, the count the group is launched at.
"""
import pytest

from horovod_sparse.agreement import communicator_of
from horovod_sparse.horovod_collectives import HorovodCollectives


@pytest.fixture(scope="module", autouse=True)
def horovod(request):
    """The module's own Horovod frontend (its global ``hvd``), initialised; the exchanges'
    communicator is Horovod's collectives, chosen for a gloo launch, of all Horovod's ranks."""
    hvd = request.module.hvd
    hvd.init()
    assert hvd.gloo_enabled(), "this group runs under horovodrun --gloo"
    comm = communicator_of(None)
    assert isinstance(comm, HorovodCollectives) and comm.reason == "gloo launch"
    assert (comm.Get_size(), comm.Get_rank()) == (hvd.size(), hvd.rank()) and hvd.size() >= 2
    yield hvd

