"""Shared by the parallel groups, which run the same pytest session on every rank.

At the end of each test (its teardown, which every rank reaches whatever happened)
the ranks agree on the outcome with one small Allgather on a private communicator:
if the test failed on another rank, it fails here too, so rank 0's report shows
every failure. A test marked ``world_sizes(2)`` (say) runs only under ``mpirun -np 2``: the
frontends' tests whose subject does not change with the process count run once, the exchanges'
at every count. Frameworks are imported by each group's own conftest.
"""
import hashlib
import os

import numpy as np
import pytest
from mpi4py import MPI

_SYNC = MPI.COMM_WORLD.Dup()
# the tests exercise the compressed step from the first one; the warm-up's own tests ask for one
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")


def pytest_collection_modifyitems(config, items):
    """Deselect the tests marked ``world_sizes(...)`` that leave out this run's process count:
    mpirun's, or Horovod's under ``horovodrun --gloo`` (``HOROVOD_SIZE``: mpi4py's world is each
    process alone there). Every rank deselects the same tests (the count is the same
    everywhere), so the ranks still run one sequence of collectives."""
    size = int(os.environ.get("HOROVOD_SIZE", MPI.COMM_WORLD.size))
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("world_sizes")
        (kept if marker is None or size in marker.args else dropped).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    item.failed_on_this_rank = getattr(item, "failed_on_this_rank", False) or report.failed
    if call.when != "teardown":
        return
    failed = np.zeros(_SYNC.size, dtype=np.int32)
    _SYNC.Allgather(np.array([item.failed_on_this_rank], dtype=np.int32), failed)
    others = [int(r) for r in np.flatnonzero(failed) if r != _SYNC.rank]
    if others and not item.failed_on_this_rank:
        report.outcome = "failed"
        report.longrepr = f"this test failed on rank(s) {others}: see their logs"


@pytest.fixture(scope="session")
def comm():
    """A communicator of the tests' own, duplicated from COMM_WORLD (for oracles)."""
    c = MPI.COMM_WORLD.Dup()
    yield c
    c.Free()


@pytest.fixture(scope="session")
def assert_identical_across_ranks(comm):
    """A check that ``array`` (any dtype) is bitwise identical on every rank."""
    def check(array):
        local = np.ascontiguousarray(array).view(np.uint8).ravel()
        gathered = np.empty((comm.size, local.size), dtype=np.uint8)
        comm.Allgather(local, gathered)
        differing = [r for r in range(comm.size) if not np.array_equal(gathered[r], gathered[0])]
        assert not differing, f"rank(s) {differing} differ from rank 0 ({local.size} bytes compared)"
    return check


@pytest.fixture(scope="session")
def average_across_ranks(comm):
    """The oracle: the average over ranks of a float array, by an independent MPI Allreduce in float64."""
    def average(array):
        local = np.asarray(array, dtype=np.float64)
        total = np.empty_like(local)
        comm.Allreduce(local, total)
        return total / comm.size
    return average


@pytest.fixture(scope="session")
def assert_same_text_across_ranks(assert_identical_across_ranks):
    """A check that ``text`` (e.g. a plan, as repr) is the same on every rank: its SHA-256
    compared bitwise (a digest has the same length everywhere, the text may not)."""
    def check(text):
        assert_identical_across_ranks(np.frombuffer(hashlib.sha256(str(text).encode()).digest(), np.uint8))
    return check


def same_tree(a, b, path="state"):
    """Raise AssertionError naming the first place where two state trees differ (arrays: dtype and bits)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} != {sorted(map(str, b))}"
        for key in a:
            same_tree(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            same_tree(x, y, f"{path}[{i}]")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b), f"{path}: arrays differ"
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.fixture(scope="session")
def assert_same_state():
    """``check(a, b)``: two compressor state trees are the same, arrays bit for bit (:func:`same_tree`)."""
    return same_tree


@pytest.fixture(scope="session")
def assert_resumed_like_uninterrupted(comm):
    """``check(resumed, uninterrupted)`` of the parameters after a resume: bit for bit at P = 2.
    From P = 3 Horovod's own dense allreduce is not bitwise repeatable between runs: it fuses the
    tensors that are ready in the same cycle (timing), and MPI picks its reduction order by the
    fused message's size; so there, within float32 rounding."""
    def check(resumed, uninterrupted):
        if comm.size <= 2:
            np.testing.assert_array_equal(resumed, uninterrupted)
        else:
            np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-5, atol=1e-6)
    return check
