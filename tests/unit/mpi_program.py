"""Launch a whole program on MPI ranks, as a user would (``mpirun -np N python NAME.py``, or
elastic Horovod's ``horovodrun --min-np ...``), for the tests that need each rank to be its own
process from start to exit: the docs' runnable examples, ranks that end apart, elastic jobs."""
import os
import sys
from pathlib import Path

from scripts_under_test import load_script

BOUNDED = load_script("bounded_run")

RUN_TIMEOUT_S = 180
#: the environment of the test runner's own launches (root allowed, Keras 2, one thread a rank, ...),
#: so that a program launched here runs as the parallel groups' ranks do
RUN_ENV = load_script("run_tests").MPI_ENV


def run_mpi_program(program_dir, name, ranks):
    """mpirun -np RANKS python NAME in PROGRAM_DIR, bounded (see :func:`_run`);
    returns (exit status, tagged output of all ranks)."""
    return _run(program_dir, ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none", "--tag-output",
                              "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none",
                              *[a for k in RUN_ENV for a in ("-x", k)], sys.executable, name])


def run_elastic_program(program_dir, name, ranks):
    """An elastic Horovod job on this host: ``horovodrun -np RANKS --min-np RANKS --max-np
    RANKS`` with a host discovery script naming ``localhost:RANKS`` (Gloo, as elastic Horovod
    always is), bounded (see :func:`_run`); returns (exit status, tagged output of all ranks)."""
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
    """CMD in PROGRAM_DIR for at most RUN_TIMEOUT_S, with every process it started killed at its
    end (scripts/bounded_run.py: elastic Horovod's workers leave the launcher's session);
    returns (exit status, output of all ranks)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_SPARSE_")}  # users' defaults
    env.update(RUN_ENV)
    status, output, _ = BOUNDED.run_bounded(cmd, RUN_TIMEOUT_S, capture=True, cwd=program_dir, env=env)
    if status == BOUNDED.TIMED_OUT:
        output += f"\n(killed after {RUN_TIMEOUT_S} s)"
    return status, output
