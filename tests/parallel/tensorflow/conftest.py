import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported

import horovod.tensorflow as hvd  # noqa: E402
import pytest  # noqa: E402

from world_sizes import mark_unmarked  # noqa: E402


@pytest.hookimpl(tryfirst=True)  # before tests/parallel/conftest.py deselects by world_sizes
def pytest_collection_modifyitems(config, items):
    """The second frontend over the exchanges that the exchange, sparsify, quantize and torch groups
    check at several counts, and TensorFlow traces every test's step (minutes per count on 2
    cores): its tests run at 2, and the modules that mark themselves also at 3 (an odd count)."""
    mark_unmarked(items, 2)


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init()
    yield hvd
