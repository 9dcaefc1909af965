import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported

import horovod.tensorflow as hvd  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init()
    yield hvd
