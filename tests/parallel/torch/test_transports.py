"""The two transports of the out-of-band exchanges on one MPI launch: mpi4py
(``HOROVOD_SPARSE_TRANSPORT=mpi``) and Horovod's own collectives (``=horovod``, what a
``horovodrun --gloo`` launch uses; :mod:`horovod_sparse.horovod_collectives`). The same steps
through the stock ``hvd.DistributedOptimizer`` give bitwise the same parameters under both,
for every compressor but ``auto`` (whose choice follows timings), at P = 2 and 3: the transport
moves the same buffers and reduces them in the same order (gTop-k: its tree folded on every
rank from its inputs, gathered, in the tree's order; Ok-Topk and TopkDSA: their posted messages
delivered by one alltoall per round, summed in the order posted). At P = 3 Horovod's process
sets (ranks 0 and 1, rank 2) exchange within themselves over either.
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse import world
from horovod_sparse.agreement import communicator_of
from horovod_sparse.horovod_collectives import HorovodCollectives
from random_regression import fit_random_regression

pytestmark = pytest.mark.world_sizes(2, 3)

STEPS = 10
SPECS = ["dense", "topk:density=0.05", "gtopk:density=0.05", "oktopk:density=0.05", "topk:density=0.05,exchange=dsa",
         "fft:exchange=oktopk", "gaussiank:density=0.05", "dgc:density=0.05", "threshold",
         "randomk:density=0.05", "qsgd", "int4", "terngrad", "onebit", "signsgd", "signum", "efsignsgd", "bf16",
         "powersgd:rank=2", "fft"]


@pytest.fixture
def transport(monkeypatch):
    """``use(name)``: exchange over ``name`` from now on, on communicators of this test's own
    (the module's cached ones are set aside, and back after the test)."""
    monkeypatch.setattr(world, "_COMMS", {})

    def use(name):
        world.forget()
        monkeypatch.setenv(world.TRANSPORT_VARIABLE, name)

    yield use
    world.forget()


def train(spec, steps=STEPS, process_set=None, **params):
    """``steps`` steps of a small MLP on this rank's own data; the flat parameters (numpy)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 24), nn.ReLU(), nn.Linear(24, 4))
    if not spec.startswith(("randomk", "auto")):
        params.setdefault("dense_below", 0)
    compression = hvds.Compression.from_spec(spec, **params)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   **({} if process_set is None else {"process_set": process_set}))
    try:
        fit_random_regression(model, opt, 48, 4, batch=8, steps=steps, seed=11 + hvd.rank())
    finally:
        getattr(compression, "close", lambda: None)()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", SPECS)
def test_both_transports_give_the_same_parameters(spec, transport, assert_identical_across_ranks):
    transport("mpi")
    over_mpi = train(spec)
    assert isinstance(communicator_of(None), MPI.Comm)
    transport("horovod")
    over_horovod = train(spec)
    comm = communicator_of(None)
    assert isinstance(comm, HorovodCollectives) and comm.reason == "HOROVOD_SPARSE_TRANSPORT=horovod"
    assert np.isfinite(over_mpi).all()
    np.testing.assert_array_equal(over_horovod.view(np.uint32), over_mpi.view(np.uint32))
    assert_identical_across_ranks(over_horovod)


@pytest.mark.world_sizes(3)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "qsgd", "powersgd:rank=2"])
def test_process_sets_over_both_transports(spec, transport, process_sets):
    """At 3 ranks, ranks 0 and 1 train in one process set and rank 2 in its own, at the same time:
    over Horovod's collectives each set's exchange runs within the set, as over mpi4py."""
    mine = next(ps for ps in process_sets if ps.included())
    transport("mpi")
    over_mpi = train(spec, process_set=mine)
    transport("horovod")
    over_horovod = train(spec, process_set=mine)
    comm = communicator_of(mine)
    assert isinstance(comm, HorovodCollectives) and (comm.Get_size(), comm.Get_rank()) == (mine.size(), mine.rank())
    np.testing.assert_array_equal(over_horovod.view(np.uint32), over_mpi.view(np.uint32))
    every = np.empty((hvd.size(), over_horovod.size), over_horovod.dtype)
    MPI.COMM_WORLD.Allgather(over_horovod, every)
    assert np.array_equal(every[0], every[1])  # the set of ranks 0 and 1 trained one replica


def test_a_transport_that_does_not_exist_is_refused(transport):
    transport("nccl")
    with pytest.raises(ValueError, match=r"HOROVOD_SPARSE_TRANSPORT must be one of \('auto', 'mpi', 'horovod'\), "
                                         r"got 'nccl'"):
        communicator_of(None)
