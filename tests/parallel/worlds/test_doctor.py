"""``horovod-sparse doctor`` where Horovod's world is not all of mpi4py's, in process at
``mpirun -np 4``: Horovod runs for real on the scenario's world (:mod:`world_scenarios`), the
doctor finds it initialised and checks it. A launch mpi4py cannot map (mpi4py's world each
process alone, as ``horovodrun --gloo`` gives; ranks of different MPI jobs) is sound over
Horovod's collectives, which the report names as the transport; with
``HOROVOD_SPARSE_TRANSPORT=mpi`` it exits 1 on every rank with the launch to use, and runs no
collective after the world check. Horovod on a part of mpi4py's world is a sound launch.

Simulated as in test_unsupported_launch.py: the world module is shown COMM_SELF as mpi4py's
world, or another MPI job name per process.
"""
import io

import horovod.torch as hvd
import pytest
from mpi4py import MPI

from horovod_sparse import cli
from horovod_sparse import world as horovod_world
from horovod_sparse.agreement import allgather_int64
from world_scenarios import CW, init_world


def doctor(judge):
    """Run the doctor on this rank; returns (exit code, the report where Horovod's rank 0
    printed it, every rank's exit code)."""
    out = io.StringIO()
    code = cli.main(["doctor", "--timeout", "60"], out=out)
    return code, out.getvalue(), allgather_int64(judge, [code])[:, 0].tolist()


@pytest.fixture
def judge():
    """The tests' own communicator of all four processes: the exit codes are compared on it."""
    comm = CW.Dup()
    yield comm
    comm.Free()


@pytest.mark.timeout(90)
def test_doctor_fails_on_every_rank_where_mpi4py_world_is_each_process_alone(monkeypatch, judge):
    init_world(hvd, "reversed 4")
    horovod_world.forget()
    monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", "mpi")
    monkeypatch.setattr(horovod_world, "mpi_world", lambda: MPI.COMM_SELF)
    code, out, codes = doctor(judge)
    assert codes == [1, 1, 1, 1]
    if hvd.rank() == 0:
        assert "FAIL  world     horovod_sparse exchanges over mpi4py among Horovod's ranks" in out, out
        assert "Horovod has 4 ranks but mpi4py's world only 1 process(es)" in out
        assert "fix: launch through MPI: `mpirun -np N ...`, or `horovodrun -np N ...` with Horovod's MPI " \
               "controller (not --gloo, nor elastic mode)" in out
        assert "WARN  link      cores, threads and link not checked" in out   # no collective after it
        assert "launch has a failing check" in out
    else:
        assert out == ""


@pytest.mark.timeout(90)
def test_doctor_passes_over_horovods_collectives_where_mpi4py_world_is_each_process_alone(monkeypatch, judge):
    init_world(hvd, "reversed 4")
    horovod_world.forget()
    monkeypatch.setattr(horovod_world, "mpi_world", lambda: MPI.COMM_SELF)
    try:
        code, out, codes = doctor(judge)
    finally:
        monkeypatch.undo()
        horovod_world.forget()
    assert codes == [0, 0, 0, 0], out
    if hvd.rank() == 0:
        assert "OK    world     4 rank(s); transport: Horovod's collectives (Horovod's ranks are not one MPI " \
               "job's)" in out, out
        assert "OK    link      allreduce over 4 ranks" in out and "launch is sound" in out


@pytest.mark.timeout(90)
def test_doctor_fails_on_every_rank_where_horovod_ranks_are_of_different_mpi_jobs(monkeypatch, judge):
    init_world(hvd, "split 2+2")
    horovod_world.forget()
    monkeypatch.setenv("HOROVOD_SPARSE_TRANSPORT", "mpi")
    monkeypatch.setenv("PMIX_NAMESPACE", f"job-{CW.Get_rank()}")
    code, out, codes = doctor(judge)
    assert codes == [1, 1, 1, 1]
    if hvd.rank() == 0:
        assert "FAIL  world" in out and "Horovod's ranks belong to different MPI jobs" in out, out


@pytest.mark.timeout(90)
def test_doctor_passes_where_horovod_runs_on_a_part_of_mpi4py_world(judge):
    init_world(hvd, "split 2+2")
    horovod_world.forget()
    code, out, codes = doctor(judge)
    assert codes == [0, 0, 0, 0], out
    if hvd.rank() == 0:
        assert "horovod-sparse doctor: 2 rank(s)" in out
        assert "OK    world     Horovod runs on 2 of mpi4py's 4 processes" in out, out
        assert "OK    link      allreduce over 2 ranks" in out and "launch is sound" in out
