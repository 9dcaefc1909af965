"""Run a command with a wall-clock bound, and leave nothing of it behind.

A process group or session does not hold everything a launch starts: Horovod's launcher starts
each worker in a session of its own, and a rank orphaned by a killed ``mpirun`` lives on under
init, holding the launch's output pipe open (a reader waiting for its end waits forever). So
every process of a launch carries a tag in its environment, which each child inherits (mpirun's
local ranks, horovodrun's workers, their own children), and whatever still carries it when the
launch ends, or when its time is up, is killed.

Usage (scripts/run_tests.py, tests/unit/mpi_program.py)::

    status, output, left = run_bounded(["mpirun", "-np", "2", ...], wall_s=900, capture=True)
"""
import os
import signal
import subprocess
import uuid
from pathlib import Path

TAG_VARIABLE = "BOUNDED_RUN_TAG"
TIMED_OUT = 124  # the exit status of a launch that ran out of time (as timeout(1) reports it)
GRACE_S = 10     # after SIGTERM, before SIGKILL: mpirun passes SIGTERM on, and ranks may still say why


def tagged_processes(tag):
    """The ids of every process on this host whose environment carries ``tag`` (this one excepted)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    yield int(entry.name)
            except OSError:  # gone meanwhile, or not ours to read
                pass


def kill_tagged(tag):
    """SIGKILL every process that carries ``tag``; returns their ids."""
    killed = []
    for pid in tagged_processes(tag):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        except ProcessLookupError:
            pass
    return killed


def run_bounded(cmd, wall_s, *, capture=False, env=None, **popen_kwargs):
    """Run ``cmd`` for at most ``wall_s`` seconds: on time, SIGTERM, then SIGKILL to all it started.

    Returns ``(status, output, left)``: the exit status (:data:`TIMED_OUT` when it ran out of
    time), its stdout and stderr together as text when ``capture`` (else None), and the ids of
    the processes it left running, which were killed."""
    tag = uuid.uuid4().hex
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True} if capture else {}
    proc = subprocess.Popen(cmd, env={**(os.environ if env is None else env), TAG_VARIABLE: tag},
                            start_new_session=True, **pipes, **popen_kwargs)
    output, timed_out = None, False
    try:
        output, _ = proc.communicate(timeout=wall_s)
    except subprocess.TimeoutExpired:
        timed_out = proc.poll() is None  # else it ended, and what it left holds the pipe open
        if timed_out:
            proc.terminate()
            try:
                proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                pass
    left = kill_tagged(tag)  # with every writer gone, the pipe ends and the reads below return
    if proc.poll() is None or output is None and capture:
        output, _ = proc.communicate()
    return (TIMED_OUT if timed_out else proc.returncode), output, left
