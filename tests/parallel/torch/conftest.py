import horovod.torch as hvd
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init()
    torch.manual_seed(0)
    yield hvd
