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


def test_the_environment_chooses_the_device_path_and_reads_other_names_as_the_default(monkeypatch):
    monkeypatch.setenv(cpu.KERNELS_ENV, "torch")
    assert cpu.device_path_chosen() and not host_shortcut_allowed(torch.zeros(1))
    # mid-step, a rank cannot raise alone: the exchange's agreement refuses it on every rank
    # (tests/unit/test_switches.py)
    monkeypatch.setenv(cpu.KERNELS_ENV, "cuda")
    assert cpu.chosen() == "numba" and not cpu.device_path_chosen()


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


@pytest.mark.parametrize("memory", ["error_feedback", "momentum_correction", "momentum"])
def test_pieces_fused_on_the_device_path_give_the_host_paths_bits(memory):
    """On the device path a step's pieces are fused by one cat, then whole-buffer passes; the
    host path visits them one by one. float64 pieces round, float16 and bfloat16 widen, alike;
    the committed state (what was sent cleared) is the same too."""
    from horovod_sparse.memory import ErrorFeedback, Momentum, MomentumCorrection
    rng = np.random.default_rng(3)
    dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float32)
    pieces = [torch.from_numpy(rng.standard_normal(size) * 3).to(dtype) for size, dtype in zip((7, 5, 4, 9, 3), dtypes)]
    n = sum(p.numel() for p in pieces)
    make = {"error_feedback": lambda: ErrorFeedback(n), "momentum_correction": lambda: MomentumCorrection(n, 0.9),
            "momentum": lambda: Momentum(n, 0.9)}[memory]
    state = {name: rng.standard_normal(n).astype(np.float32) for name in make().state_names}
    results = {}
    for path in (cpu.numpy_only, cpu.device_path):
        with path():
            mem = make()
            mem.load_state_dict(state)
            acc = mem.accumulate_pieces(pieces)
            acc_bytes = acc.numpy().tobytes()
            mem.commit_cleared(acc, torch.tensor([0, 3, n - 1]))
            results[path.__name__] = acc_bytes, {k: v.tobytes() for k, v in mem.state_dict().items()}
    assert results["numpy_only"] == results["device_path"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (scripts/cuda_check.sh runs this case on one)"))])
def test_several_arrays_cross_once_each_way_packed(device):
    """A sparse exchange's indices and values (and whatever rides with them) cross in one
    transfer each way where they must cross (the device path on the CPU; a GPU, through pinned
    memory): packed byte-wise, widest dtype first, handed out as views with their own dtypes and
    values; empty and odd-length pieces included."""
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(7).astype(np.float32), rng.integers(-2**40, 2**40, 5),
              np.array([True, False, True]), np.arange(3, dtype=np.int32),
              rng.standard_normal(1).astype(np.float16), np.empty(0, np.int64)]
    tensors = [torch.from_numpy(a).to(device) for a in arrays]
    nbytes = sum(a.nbytes for a in arrays)
    with cpu.device_path():
        host.HOST_TRAFFIC.reset()
        crossed = host.to_host_packed(*tensors)
        assert host.HOST_TRAFFIC.snapshot()["transfers_out"] == 1 and host.HOST_TRAFFIC.bytes_out == nbytes
        for a, c, t in zip(arrays, crossed, tensors):
            assert c.dtype == a.dtype and np.array_equal(c, a)
            assert device != "cpu" or not np.shares_memory(c, t.numpy())  # a copy, as from a GPU
        back = host.from_host_packed(crossed, tensors[0])
        assert host.HOST_TRAFFIC.snapshot()["transfers_in"] == 1 and host.HOST_TRAFFIC.bytes_in == nbytes
        for t, b in zip(tensors, back):
            assert b.device == t.device and b.dtype == t.dtype and torch.equal(b, t)
    if device == "cpu":  # the host's shortcut: CPU tensors cross as zero-copy views, one count each
        host.HOST_TRAFFIC.reset()
        crossed = host.to_host_packed(*tensors[:2])
        assert host.HOST_TRAFFIC.snapshot()["transfers_out"] == 2
        assert all(np.shares_memory(c, t.numpy()) for c, t in zip(crossed, tensors[:2]))
