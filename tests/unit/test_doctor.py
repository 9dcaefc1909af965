"""``horovod-sparse doctor`` launched for real, the way a user launches it: ``mpirun -np 2``
of the command line, with and without Open MPI's ``mpi_yield_when_idle``. Each rank echoes
its own exit code, so the test sees that every rank agrees. ``--cores 1`` makes "ranks
outnumber cores" the same on any machine. Bad arguments exit 2 in process (no MPI starts).
The launches where mpi4py's world is not Horovod's are in tests/parallel/worlds/test_doctor.py."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from horovod_sparse import doctor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
YIELD = ["--mca", "mpi_yield_when_idle", "1"]

needs_mpirun = pytest.mark.skipif(shutil.which("mpirun") is None, reason="needs Open MPI's mpirun")


def launch(mpirun_args, doctor_args):
    """``mpirun -np 2 <mpirun_args> python -m horovod_sparse.cli doctor <doctor_args>``, each rank
    printing ``rank R exit C`` after it; returns (mpirun's code, output, {rank: exit code})."""
    env = {k: v for k, v in os.environ.items() if k != doctor.YIELD_VARIABLE}  # the test says whether to yield
    env.update(OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = " ".join([sys.executable, "-m", "horovod_sparse.cli", "doctor", "--timeout", "60", *doctor_args])
    r = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", *mpirun_args, "sh", "-c",
                        f'{command}; code=$?; echo "rank $OMPI_COMM_WORLD_RANK exit $code"; exit $code'],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    out = r.stdout + r.stderr
    codes = {int(rank): int(code) for rank, code in re.findall(r"rank (\d+) exit (\d+)", out)}
    return r.returncode, out, codes


@needs_mpirun
def test_a_sound_launch_exits_0_on_every_rank(tmp_path):
    report = tmp_path / "doctor.json"
    rc, out, codes = launch(YIELD, ["--json", str(report)])
    assert rc == 0 and codes == {0: 0, 1: 0}, out
    assert out.count("horovod-sparse doctor: 2 rank(s)") == 1, out   # rank 0 alone reports
    for line in ("OK    world     mpi4py's world is Horovod's: 2 rank(s)", "OK    mpi       ",
                 "OK    horovod   Horovod ", "OK    switches  HOROVOD_SPARSE_KERNELS=",
                 "OK    cores     2 rank(s) on this node",
                 "mpi_yield_when_idle=1", "OK    link      allreduce over 2 ranks", "OK    whatif    netai:resnet50",
                 "launch is sound"):
        assert line in out, out
    assert "FAIL" not in out
    saved = json.loads(report.read_text())
    assert saved["exit"] == 0 and saved["ranks"] == 2
    assert {c["check"] for c in saved["checks"]} >= {"world", "mpi", "horovod", "cuda", "switches", "versions", "cores",
                                                     "threads", "link", "whatif"}


@needs_mpirun
def test_ranks_that_outnumber_cores_without_yielding_fail_on_every_rank():
    if doctor.mpi_yields(environ={}):
        pytest.skip("an Open MPI parameter file on this machine sets mpi_yield_when_idle")
    rc, out, codes = launch([], ["--cores", "1"])
    assert rc != 0 and codes == {0: 1, 1: 1}, out
    assert "FAIL  cores     2 rank(s) on this node, 1 core(s) for them; mpi_yield_when_idle not set" in out, out
    assert "fix: pass `--mca mpi_yield_when_idle 1` to mpirun" in out
    assert "launch has a failing check" in out


@needs_mpirun
def test_ranks_that_outnumber_cores_and_yield_only_warn():
    rc, out, codes = launch(YIELD, ["--cores", "1"])
    assert rc == 0 and codes == {0: 0, 1: 0}, out
    assert "WARN  cores     2 rank(s) on this node, 1 core(s) for them; mpi_yield_when_idle=1" in out, out
    assert "launch is sound" in out


def test_a_switch_set_to_none_of_its_choices_fails(monkeypatch):
    monkeypatch.delenv("HOROVOD_SPARSE_KERNELS", raising=False)
    monkeypatch.setenv("HOROVOD_SPARSE_DEVICE_BUFFERS", "off")
    assert doctor.check_switches()["status"] == doctor.OK
    assert "HOROVOD_SPARSE_DEVICE_BUFFERS=off" in doctor.check_switches()["found"]
    monkeypatch.setenv("HOROVOD_SPARSE_KERNELS", "cuda")
    failed = doctor.check_switches()
    assert failed["status"] == doctor.FAIL
    assert failed["found"] == "HOROVOD_SPARSE_KERNELS must be one of ['numba', 'numpy', 'torch'], got 'cuda'"


def test_the_yield_setting_is_read_from_the_environment_then_the_parameter_files(tmp_path):
    conf = tmp_path / "mca-params.conf"
    conf.write_text("# Open MPI parameters\nbtl = ^openib\nmpi_yield_when_idle = 1\n")
    assert doctor.mpi_yields(environ={doctor.YIELD_VARIABLE: "1"}, files=())
    assert not doctor.mpi_yields(environ={doctor.YIELD_VARIABLE: "0"}, files=[str(conf)])
    assert doctor.mpi_yields(environ={}, files=[str(tmp_path / "absent.conf"), str(conf)])
    assert not doctor.mpi_yields(environ={}, files=[str(tmp_path / "absent.conf")])


def test_the_cores_check_fails_only_where_waiting_ranks_busy_poll():
    assert doctor.check_cores(2, 2, yields=False)["status"] == doctor.OK
    assert doctor.check_cores(3, 2, yields=True)["status"] == doctor.WARN
    failed = doctor.check_cores(3, 2, yields=False)
    assert failed["status"] == doctor.FAIL and "--mca mpi_yield_when_idle 1" in failed["fix"]
    gloo = doctor.check_cores(3, 2, yields=False, mpi_waits=False)  # horovodrun --gloo: no MPI wait to yield
    assert gloo["status"] == doctor.WARN and "no rank waits in MPI" in gloo["found"]
