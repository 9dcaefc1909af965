"""Launch a whole program on MPI ranks, as a user would (``mpirun -np N python NAME.py``, or
elastic Horovod's ``horovodrun --min-np ...``), for the tests that need each rank to be its own
process from start to exit: the docs' runnable examples, ranks that end apart, elastic jobs."""
import os
import signal
import subprocess
import sys
from pathlib import Path

RUN_TIMEOUT_S = 180
RUN_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",   # the CI runs as root
    "TF_USE_LEGACY_KERAS": "1",            # Horovod 0.28 needs Keras 2; the README says to set it
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "OMP_NUM_THREADS": "1",                # ranks outnumber cores: one compute thread each
    "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1",
}


def run_mpi_program(program_dir, name, ranks):
    """mpirun -np RANKS python NAME in PROGRAM_DIR, in its own process group (a timeout ends
    every rank); returns (exit status, tagged output of all ranks)."""
    return _run(program_dir, ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", "--tag-output",
                              "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none",
                              *[a for k in RUN_ENV for a in ("-x", k)], sys.executable, name])


def run_elastic_program(program_dir, name, ranks):
    """An elastic Horovod job on this host: ``horovodrun -np RANKS --min-np RANKS --max-np
    RANKS`` with a host discovery script naming ``localhost:RANKS`` (Gloo, as elastic Horovod
    always is), in its own process group; returns (exit status, tagged output of all ranks)."""
    return _run_elastic(program_dir, f"echo localhost:{ranks}", (ranks, ranks, ranks), [], [name])


def run_resizing_program(program_dir, name, *args):
    """An elastic job on this host that loses a worker and gets it back: ``horovodrun -np 3
    --min-np 2 --max-np 3`` over the hosts ``localhost:2`` and ``127.0.0.1:1`` (two names of
    this host, as Horovod's own elastic tests use), whose discovery script drops ``127.0.0.1``
    while the file ``phase`` in PROGRAM_DIR says ``1`` (the program writes it). The removed
    worker exits; Horovod blacklists its host, for 1-2 s only (``--blacklist-cooldown-range``),
    so that it can come back. Returns (exit status, tagged output of all ranks)."""
    hosts = 'echo localhost:2\n[ "$(cat "$(dirname "$0")/phase" 2>/dev/null)" = 1 ] || echo 127.0.0.1:1'
    return _run_elastic(program_dir, hosts, (3, 2, 3), ["--blacklist-cooldown-range", "1", "2"], [name, *args])


def _run_elastic(program_dir, discovery, sizes, options, program):
    """``horovodrun -np/--min-np/--max-np *sizes* OPTIONS python PROGRAM...`` in PROGRAM_DIR, its
    host discovery script the shell lines ``discovery``; see :func:`_run`."""
    discover = Path(program_dir) / "discover_hosts.sh"
    discover.write_text(f"#!/bin/sh\n{discovery}\n")
    discover.chmod(0o755)
    horovodrun = str(Path(sys.executable).parent / "horovodrun")
    np_, min_np, max_np = (str(size) for size in sizes)
    # one host only: name its interface, or the driver waits for a second host to compare interfaces with
    return _run(program_dir, [horovodrun, "-np", np_, "--min-np", min_np, "--max-np", max_np,
                              "--host-discovery-script", str(discover), "--network-interface", "lo",
                              "--elastic-timeout", "60", *options, sys.executable, *program])


def _run(program_dir, cmd):
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_SPARSE_")}  # users' defaults
    env.update(RUN_ENV)
    proc = subprocess.Popen(cmd, cwd=program_dir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.terminate()                   # mpirun passes SIGTERM on to the ranks
        try:
            output, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            kill_session(proc.pid)
            output, _ = proc.communicate()
        kill_session(proc.pid)             # ranks left behind (each in its own process group)
        output += f"\n(killed after {RUN_TIMEOUT_S} s)"
    return proc.returncode, output


def kill_session(session):
    """SIGKILL every process of the session mpirun started (``start_new_session``)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getsid(int(entry.name)) == session:
                    os.kill(int(entry.name), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
