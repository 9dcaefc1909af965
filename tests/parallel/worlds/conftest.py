"""Horovod on a part of COMM_WORLD: every test module initialises the Horovod frontend it
needs on its scenario's world (:mod:`world_scenarios`), and the run ends with Horovod
shut down. Run at ``mpirun -np 4`` only: the scenarios name four processes."""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported

import pytest  # noqa: E402

from world_scenarios import SCENARIOS, shutdown  # noqa: E402
from world_sizes import mark_unmarked  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before tests/parallel/conftest.py deselects by world_sizes
def pytest_collection_modifyitems(config, items):
    """Mark every test ``world_sizes(4)``; run the scenarios that pass hvd.init a list of ranks last
    (stable: each module's order otherwise kept), since Horovod 0.28.1 keeps such a list through
    hvd.shutdown() and uses it at every later hvd.init of that frontend."""
    mark_unmarked(items, 4)

    def listed(item):
        params = getattr(getattr(item, "callspec", None), "params", {})
        return any(isinstance(v, str) and SCENARIOS.get(v, ("",))[0] == "ranks" for v in params.values())

    items.sort(key=listed)


@pytest.fixture(scope="session", autouse=True)
def horovod_shut_down_at_the_end():
    yield
    shutdown()  # only reached at -np 4: elsewhere every test is deselected
