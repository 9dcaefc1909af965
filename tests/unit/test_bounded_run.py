"""scripts/bounded_run.py: a launch that outlives its bound is ended, and so is everything it
started, even a process in a session of its own holding the launch's output open (as elastic
Horovod's workers are, and orphaned ranks), so that neither the caller nor the test run waits."""
import time

from scripts_under_test import load_script

bounded = load_script("bounded_run")

# a child that leaves the launch's session and keeps its output pipe open for ten minutes
ESCAPING_CHILD = "setsid sleep 600 & echo started; "


def test_a_launch_past_its_bound_is_killed_with_all_it_started():
    begin = time.monotonic()
    status, output, left = bounded.run_bounded(["sh", "-c", ESCAPING_CHILD + "sleep 600"], 2, capture=True)
    assert status == bounded.TIMED_OUT and output.startswith("started")
    assert time.monotonic() - begin < 2 + bounded.GRACE_S + 10
    assert left, "the escaped child was not found"
    assert _all_gone(left)


def test_what_a_finished_launch_leaves_running_is_killed_and_reported():
    begin = time.monotonic()
    status, output, left = bounded.run_bounded(["sh", "-c", ESCAPING_CHILD + "exit 3"], 5, capture=True)
    assert status == 3 and output == "started\n" and len(left) == 1
    assert time.monotonic() - begin < 5 + 10
    assert _all_gone(left)


def test_a_clean_launch_leaves_nothing_and_keeps_its_status():
    assert bounded.run_bounded(["sh", "-c", "echo hi; exit 0"], 5, capture=True) == (0, "hi\n", [])
    assert bounded.run_bounded(["true"], 5) == (0, None, [])


def _all_gone(pids, wait_s=5):
    """Every one of ``pids`` has ended (gone, or a zombie) within ``wait_s`` (SIGKILL is not instant)."""
    end = time.monotonic() + wait_s
    while any(_alive(pid) for pid in pids):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True


def _alive(pid):
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
