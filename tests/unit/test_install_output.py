"""The step runner of ``make install`` (``scripts/install_steps.sh``), run with real bash: one
line per step with its time, the output in the log, a failing step's whole output shown."""
import os
import re
import subprocess

import pytest

STEPS = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                      "..", "..", "scripts", "install_steps.sh"))
TIME = r"\(\d+\.\d s\)"


def run_steps(script, tmp_path, verbose=None):
    """Runs ``script`` after sourcing the step runner, as scripts/install.sh does."""
    env = {k: v for k, v in os.environ.items() if k not in ("VERBOSE", "INSTALL_LOG")}
    env["INSTALL_LOG"] = str(tmp_path / "logs" / "install.log")
    if verbose is not None:
        env["VERBOSE"] = verbose
    prologue = f"set -euo pipefail\nsource '{STEPS}'\nsteps_begin\n"
    return subprocess.run(["bash", "-c", prologue + script], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)


def log_of(tmp_path):
    return (tmp_path / "logs" / "install.log").read_text()


def test_succeeding_step_prints_one_line_and_logs_its_output(tmp_path):
    proc = run_steps("""
        noisy() { echo "lots of pip output"; echo "a TensorFlow warning" >&2; }
        step "pinned dependencies" noisy
        step "Open MPI" --skip-if true noisy
        steps_end "ok: all installed"
        """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 3, proc.stdout
    assert re.fullmatch(rf"\[install\] pinned dependencies \.\.\. done {TIME}", lines[0])
    assert re.fullmatch(rf"\[install\] Open MPI \.\.\. present {TIME}", lines[1])
    assert re.fullmatch(r"\[install\] ok: all installed \(total \d+\.\d s; full log: \S+install\.log\)",
                        lines[2])
    assert proc.stderr == ""
    log = log_of(tmp_path)
    assert "lots of pip output" in log and "a TensorFlow warning" in log
    assert log.count("lots of pip output") == 1  # the skipped step did not run


def test_failing_step_exits_nonzero_and_shows_its_whole_output(tmp_path):
    proc = run_steps("""
        step "first" echo "output of the first step"
        build() {
            for i in $(seq 1 300); do echo "build line $i"; done
            echo "fatal: the compiler failed" >&2
            false
            echo "not reached: set -e holds inside the step"
        }
        step "building Horovod" build
        step "never" echo "not run"
        """, tmp_path)
    assert proc.returncode == 1
    assert re.search(r"^\[install\] building Horovod \.\.\. FAILED \(exit status 1, \d+\.\d s\)$",
                     proc.stdout, re.M)
    assert "never" not in proc.stdout + proc.stderr
    # the failing step's whole output, and only that step's
    assert all(f"build line {i}\n" in proc.stderr for i in range(1, 301))
    assert "fatal: the compiler failed" in proc.stderr
    assert "not reached" not in proc.stderr
    assert "output of the first step" not in proc.stderr
    log_path = str(tmp_path / "logs" / "install.log")
    assert f"full log: {log_path}" in proc.stderr
    assert "output of the first step" in log_of(tmp_path)


def test_failing_step_keeps_its_exit_status(tmp_path):
    proc = run_steps('step "check" bash -c "echo check-output; exit 7"', tmp_path)
    assert proc.returncode == 7
    assert "check-output" in proc.stderr


def test_a_missing_check_runs_the_step_and_its_noise_is_only_logged(tmp_path):
    proc = run_steps("""
        have_it() { echo "Traceback: not installed yet" >&2; return 1; }
        step "torchvision" --skip-if have_it bash -c "echo pip-error; exit 1"
        """, tmp_path)
    assert proc.returncode == 1
    assert "pip-error" in proc.stderr
    assert "Traceback" not in proc.stderr  # the check failing is expected, not the error
    assert "Traceback: not installed yet" in log_of(tmp_path)


@pytest.mark.parametrize("verbose", ["", "0"])
def test_quiet_unless_verbose_is_set(tmp_path, verbose):
    proc = run_steps('step "s" echo streamed-output', tmp_path, verbose=verbose)
    assert proc.returncode == 0
    assert "streamed-output" not in proc.stdout + proc.stderr


def test_verbose_streams_everything(tmp_path):
    proc = run_steps("""
        step "noisy" bash -c "echo out-line; echo err-line >&2"
        steps_end ok
        """, tmp_path, verbose="1")
    assert proc.returncode == 0, proc.stderr
    assert "out-line" in proc.stdout and "err-line" in proc.stdout
    assert re.search(rf"^\[install\] noisy \.\.\. done {TIME}$", proc.stdout, re.M)
    assert "out-line" in log_of(tmp_path)  # and still logged


def test_a_long_step_names_itself_when_it_starts(tmp_path):
    """A long step (the ~8 minute Horovod build) must not look hung: its label comes first."""
    env = {k: v for k, v in os.environ.items() if k != "VERBOSE"}
    env["INSTALL_LOG"] = str(tmp_path / "install.log")
    script = f"set -eu; source '{STEPS}'; step 'building Horovod (about 8 minutes)' sleep 3"
    proc = subprocess.Popen(["bash", "-c", script], env=env, stdout=subprocess.PIPE)
    try:
        first = proc.stdout.read(len("[install] building Horovod (about 8 minutes) ... "))
        assert first == b"[install] building Horovod (about 8 minutes) ... "
        assert proc.poll() is None  # printed while the step still runs
        rest = proc.stdout.read()
    finally:
        proc.wait(timeout=30)
    assert re.fullmatch(rb"done \(3\.\d s\)\n", rest)


def test_seconds_format(tmp_path):
    proc = subprocess.run(["bash", "-c", f"source '{STEPS}'; for us in 0 49999 93420000 412000000; "
                                         f"do _step_secs $us; echo; done"],
                          capture_output=True, text=True, timeout=30)
    assert proc.stdout.splitlines() == ["0.0 s", "0.0 s", "93.4 s", "412 s"]
