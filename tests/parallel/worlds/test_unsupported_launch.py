"""Where Horovod's ranks are not processes of one MPI job (``horovodrun --gloo``, elastic), the
PyTorch frontend's exchanges run over Horovod's own collectives (``HOROVOD_SPARSE_TRANSPORT``
``auto``, the default): the first steps train and every rank ends with the same parameters.
With ``HOROVOD_SPARSE_TRANSPORT=mpi`` every rank raises the same HorovodWorldError, which says
how to launch; none sums over a wrong world, none waits.

The launches are simulated here (tests/parallel/gloo runs a real ``horovodrun --gloo``): the
module under test is shown another mpi4py world than the real one (COMM_SELF, as
``horovodrun --gloo`` and elastic Horovod give each process; or a Split of COMM_WORLD across
Horovod's jobs), or another MPI job name. Horovod itself runs for real, on four processes or
on the 2+2 split.
"""
import contextlib

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse import world as horovod_world
from horovod_sparse.agreement import allgather_text, communicator_of
from horovod_sparse.checkpoint import gather_state
from horovod_sparse.horovod_collectives import HorovodCollectives
from horovod_sparse.world import HorovodWorldError
from world_scenarios import CW, assert_identical, init_world

HINT = r"Launch the job through MPI: `horovodrun -np N \.\.\.` with Horovod's MPI controller \(not --gloo"
NOT_ONE_JOB = "Horovod's ranks are not one MPI job's"


@pytest.fixture
def judge():
    """The tests' own communicator of all four processes: the raised texts are compared on it."""
    comm = CW.Dup()
    yield comm
    comm.Free()


def assert_same_text_everywhere(judge, text):
    texts = allgather_text(judge, text)
    assert all(other == texts[0] for other in texts), texts


def train(spec="topk:density=0.01", steps=1):
    """``steps`` training steps through the stock DistributedOptimizer; the flat parameters."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))
    compression = hvds.Compression.from_spec(spec)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    try:
        for step in range(steps):
            opt.zero_grad()
            model(torch.ones(4, 40) * (hvd.rank() + step)).pow(2).mean().backward()
            opt.step()
    finally:
        getattr(compression, "close", lambda: None)()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def first_step_raises(spec="topk:density=0.01"):
    """A first training step through the stock DistributedOptimizer; returns what it raised."""
    with pytest.raises(HorovodWorldError) as raised:
        train(spec)
    return str(raised.value)


@contextlib.contextmanager
def mpi4py_world(monkeypatch, comm):
    """The world module shown ``comm`` as mpi4py's world, its communicators mapped anew."""
    horovod_world.forget()
    monkeypatch.setattr(horovod_world, "mpi_world", lambda: comm)
    try:
        yield
    finally:
        monkeypatch.undo()
        horovod_world.forget()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", ["topk:density=0.01", "dense", "qsgd"])
def test_a_launch_without_mpi_raises_on_every_rank_with_the_mpi_transport(spec, monkeypatch, judge):
    """Horovod of 4 ranks, mpi4py's world each process alone (gloo, elastic), the transport forced
    to mpi4py: the first step, communicator_of and gather_state raise on every rank, with the
    launch to use instead."""
    init_world(hvd, "reversed 4")
    monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", "mpi")
    with mpi4py_world(monkeypatch, MPI.COMM_SELF):
        text = first_step_raises(spec)
        assert "Horovod has 4 ranks but mpi4py's world only 1 process(es)" in text
        assert text.endswith("(HOROVOD_SPARSE_TRANSPORT=mpi)")
        with pytest.raises(HorovodWorldError, match=HINT):
            communicator_of(None)
        with pytest.raises(HorovodWorldError, match=HINT):
            gather_state(hvds.Compression.from_spec(spec))
    assert_same_text_everywhere(judge, text)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", ["topk:density=0.01", "dense", "qsgd"])
def test_a_launch_without_mpi_trains_over_horovods_collectives(spec, monkeypatch, judge):
    """The same launch with the default transport: the exchanges run over Horovod's collectives,
    among Horovod's 4 ranks in Horovod's order, and every replica ends the same."""
    init_world(hvd, "reversed 4")
    with mpi4py_world(monkeypatch, MPI.COMM_SELF):
        comm = communicator_of(None)
        assert isinstance(comm, HorovodCollectives) and comm.reason == NOT_ONE_JOB
        assert (comm.Get_size(), comm.Get_rank()) == (hvd.size(), hvd.rank()) == (4, 3 - CW.Get_rank())
        params = train(spec, steps=3)
    assert np.isfinite(params).all()
    assert_identical(judge, params)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["mpi", "auto"])
def test_ranks_of_different_mpi_jobs(transport, monkeypatch, judge):
    """Each process named another MPI job (as two mpiruns joined by one Horovod job would be):
    Horovod's allgather of the MPI ranks shows it; with the mpi transport every rank of each
    world raises, with auto each world trains over Horovod's collectives."""
    init_world(hvd, "split 2+2")
    horovod_world.forget()
    monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", transport)
    monkeypatch.setenv("PMIX_NAMESPACE", f"job-{CW.Get_rank()}")
    try:
        if transport == "mpi":
            text = first_step_raises()
            assert "Horovod's ranks belong to different MPI jobs" in text
            assert_same_text_everywhere(judge, text)
        else:
            params = train(steps=2)
            assert communicator_of(None).reason == NOT_ONE_JOB
            every = np.empty((CW.Get_size(), params.size), params.dtype)
            judge.Allgather(params, every)
            partner = CW.Get_rank() ^ 1  # the other rank of this rank's world (0+1, 2+3)
            assert np.array_equal(every[partner], params)
    finally:
        monkeypatch.undo()
        horovod_world.forget()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["mpi", "auto"])
def test_processes_that_are_not_one_horovod_job(transport, monkeypatch, judge):
    """mpi4py's world as large as Horovod's but made of processes of two Horovod jobs (COMM_WORLD
    ranks 0, 2 and 1, 3 beside the 2+2 split): its Split would pass, the check after it does not;
    with auto the exchanges then run over Horovod's collectives."""
    init_world(hvd, "split 2+2")
    across = CW.Split(CW.Get_rank() % 2, CW.Get_rank())
    monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", transport)
    try:
        with mpi4py_world(monkeypatch, across):
            if transport == "mpi":
                text = first_step_raises()
                assert "but they are not Horovod's ranks 0..1 of one Horovod job" in text
                assert_same_text_everywhere(judge, text)
            else:
                assert np.isfinite(train()).all()
                assert communicator_of(None).reason == NOT_ONE_JOB
    finally:
        across.Free()
