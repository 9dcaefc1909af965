"""The PyTorch frontend under ``horovodrun --gloo`` (scripts/run_tests.py launches this group
with horovodrun, not mpirun): Horovod's ranks are Gloo's, mpi4py's world is each process
alone, and the out-of-band exchanges run over Horovod's own collectives
(:mod:`horovod_sparse.horovod_collectives`).

The tests here are not marked ``world_sizes``: mpi4py's world has one process on every rank,
so tests/parallel/conftest.py's selection (and its failure sync over mpi4py) sees one rank.
The run's outcome merges every rank's JUnit file.
"""
import horovod.torch as hvd
import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def horovod():
    hvd.init()
    assert hvd.gloo_enabled(), "this group runs under horovodrun --gloo"
    torch.manual_seed(0)
    yield hvd
