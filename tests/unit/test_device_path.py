"""The device path on the CPU (``HOROVOD_SPARSE_KERNELS=torch``, ``cpu.device_path()``): one
predicate decides every "CPU tensor -> numpy view / compiled kernel" shortcut, numpy arrays keep
numpy's path, the block is per thread, and a pipeline's step then dispatches torch's ops."""
import threading

import numpy as np
import pytest
import torch
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu, host
from horovod_sparse.ops.counting import DeviceCounts
from horovod_sparse.ops.namespace import host_shortcut_allowed
from horovod_sparse.ops.views import numpy_view


def test_cpu_tensors_take_the_host_shortcuts_unless_the_device_path_is_chosen():
    t, a = torch.zeros(4), np.zeros(4, np.float32)
    assert host_shortcut_allowed(t) and numpy_view(t) is not None
    with cpu.device_path():
        assert not host_shortcut_allowed(t) and numpy_view(t) is None
        assert host_shortcut_allowed(a) and numpy_view(a) is a  # the oracle keeps numpy's path
        assert not cpu.enabled()  # no compiled kernels either
        with cpu.numpy_only():  # the innermost block decides
            assert host_shortcut_allowed(t) and not cpu.enabled()
        assert not host_shortcut_allowed(t)
    assert host_shortcut_allowed(t)


def test_the_environment_chooses_the_device_path_and_refuses_other_names(monkeypatch):
    monkeypatch.setenv(cpu.KERNELS_ENV, "torch")
    assert cpu.device_path_chosen() and not host_shortcut_allowed(torch.zeros(1))
    monkeypatch.setenv(cpu.KERNELS_ENV, "cuda")
    with pytest.raises(ValueError, match="HOROVOD_SPARSE_KERNELS must be one of .*'torch'.*'cuda'"):
        cpu.chosen()


def test_the_block_holds_in_its_own_thread_only():
    seen = []
    with cpu.device_path():
        thread = threading.Thread(target=lambda: seen.append(host_shortcut_allowed(torch.zeros(1))))
        thread.start()
        thread.join()
    assert seen == [True]


def test_the_counts_see_scalar_reads_data_dependent_shapes_and_host_crossings():
    t = torch.arange(6.0)
    counts = DeviceCounts()
    with counts:
        t.sum().item()
        t[t > 2].sum()                   # a boolean index: nonzero
        host.to_list(torch.tensor([1]))  # a read the dispatcher never sees
        host.from_host(host.to_host(t), t)
    with counts:  # blocks add up
        bool(t[0] == 0)
    summary = counts.summary()
    assert summary["syncs"] == 4, counts.ops
    assert (summary["transfers_out"], summary["bytes_out"], summary["transfers_in"], summary["bytes_in"]) == (1, 24, 1, 24)
    assert summary["ops"] == sum(counts.ops.values()) > 4


@pytest.mark.parametrize("spec", ["topk:density=0.05,warmup_steps=0", "qsgd:bucket_size=128"])
def test_a_step_under_the_device_path_runs_torch_ops(spec):
    """The same step dispatches a handful of ops on the host's path (views of the buffers) and
    the whole computation on the device path."""
    layout = GradientLayout([("w", (40, 32), "float32"), ("b", (40,), "float32")])
    ops = {}
    for path in (cpu.numpy_only, cpu.device_path):
        with path(), horovod_sparse.create(spec).make_pipeline(layout.n, MPI.COMM_SELF, layout=layout) as pipe:
            counts = DeviceCounts()
            with counts:
                grad = torch.from_numpy(np.random.default_rng(0).standard_normal(layout.n).astype(np.float32))
                getattr(pipe, "step_sparse", pipe.step)(grad, tag=layout.tag)
            ops[path.__name__] = counts.ops
    assert ops["device_path"]["abs"] >= 1 and ops["numpy_only"]["abs"] == 0
