"""Where Horovod's ranks are not processes of one MPI job, every rank raises the same
HorovodWorldError, which says how to launch; none sums over a wrong world, none waits.

The launches this Horovod build cannot make are simulated: the module under test is shown
another mpi4py world than the real one (COMM_SELF, as ``horovodrun --gloo`` and elastic Horovod
give each process; or a Split of COMM_WORLD across Horovod's jobs), or another MPI job name.
Horovod itself runs for real, on four processes or on the 2+2 split.
"""
import horovod.torch as hvd
import pytest
import torch
from mpi4py import MPI
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse import world as horovod_world
from horovod_sparse.agreement import allgather_text, communicator_of
from horovod_sparse.checkpoint import gather_state
from horovod_sparse.world import HorovodWorldError
from world_scenarios import CW, init_world

HINT = r"Launch the job through MPI: `horovodrun -np N \.\.\.` with Horovod's MPI controller \(not --gloo"


@pytest.fixture
def judge():
    """The tests' own communicator of all four processes: the raised texts are compared on it."""
    comm = CW.Dup()
    yield comm
    comm.Free()


def assert_same_text_everywhere(judge, text):
    texts = allgather_text(judge, text)
    assert all(other == texts[0] for other in texts), texts


def first_step_raises(spec="topk:density=0.01"):
    """A first training step through the stock DistributedOptimizer; returns what it raised."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 40))
    compression = hvds.Compression.from_spec(spec)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    with pytest.raises(HorovodWorldError) as raised:
        opt.zero_grad()
        model(torch.ones(4, 40)).pow(2).mean().backward()
        opt.step()
    return str(raised.value)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", ["topk:density=0.01", "dense", "qsgd"])
def test_a_launch_without_mpi_raises_on_every_rank(spec, monkeypatch, judge):
    """Horovod of 4 ranks, mpi4py's world each process alone (gloo, elastic): the first step,
    communicator_of and gather_state raise on every rank, with the launch to use instead."""
    init_world(hvd, "reversed 4")
    horovod_world.forget()
    monkeypatch.setattr(horovod_world, "mpi_world", lambda: MPI.COMM_SELF)
    text = first_step_raises(spec)
    assert "Horovod has 4 ranks but mpi4py's world only 1 process(es)" in text
    with pytest.raises(HorovodWorldError, match=HINT):
        communicator_of(None)
    with pytest.raises(HorovodWorldError, match=HINT):
        gather_state(hvds.Compression.from_spec(spec))
    assert_same_text_everywhere(judge, text)


@pytest.mark.timeout(90)
def test_ranks_of_different_mpi_jobs_raise_on_every_rank(monkeypatch, judge):
    """Each process named another MPI job (as two mpiruns joined by one Horovod job would be):
    Horovod's allgather of the MPI ranks shows it, and every rank of each world raises."""
    init_world(hvd, "split 2+2")
    horovod_world.forget()
    monkeypatch.setenv("PMIX_NAMESPACE", f"job-{CW.Get_rank()}")
    text = first_step_raises()
    assert "Horovod's ranks belong to different MPI jobs" in text
    assert_same_text_everywhere(judge, text)


@pytest.mark.timeout(90)
def test_processes_that_are_not_one_horovod_job_raise_on_every_rank(monkeypatch, judge):
    """mpi4py's world as large as Horovod's but made of processes of two Horovod jobs (COMM_WORLD
    ranks 0, 2 and 1, 3 beside the 2+2 split): its Split would pass, the check after it does not."""
    init_world(hvd, "split 2+2")
    horovod_world.forget()
    across = CW.Split(CW.Get_rank() % 2, CW.Get_rank())
    try:
        monkeypatch.setattr(horovod_world, "mpi_world", lambda: across)
        text = first_step_raises()
        assert "but they are not Horovod's ranks 0..1 of one Horovod job" in text
        assert_same_text_everywhere(judge, text)
    finally:
        monkeypatch.undo()
        horovod_world.forget()
        across.Free()
