"""Training on CUDA through the stock hvd.DistributedOptimizer, with out-of-band compressors.

Why: on a GPU the PyTorch frontend fuses the gradients on the device and the pipelines run
torch's kernels there (only their payloads cross to the host for mpi4py), a path the CPU runs
of tests/parallel/torch/ never take. One compressor of each family (topk, qsgd, powersgd, and
the out-of-band float32 sum ``dense``), with ``dense_below=0`` so that every gradient, biases
included, goes through the compressor. Every step is checked against an oracle: the numpy
pipeline of the same compressor fed each rank's local gradients (read from ``p.grad`` after
backward, before Horovod's ``synchronize`` writes the result into it), summed with mpi4py, by
parameter name in sorted order; after the last step the replicas' parameters must be bitwise
identical on every rank.

The ``cpu-device-path`` case runs CPU tensors through the code a CUDA tensor runs
(``HOROVOD_SPARSE_KERNELS=torch``: torch's own ops, the packed host crossings, PowerSGD's
batched products), at P = 2 and 3; ``cpu-device-buffers`` does too, its payloads handed to
mpi4py as they are (``HOROVOD_SPARSE_DEVICE_BUFFERS=on``), as a GPU's go to an MPI with CUDA
support (``-rank0``: on rank 0 alone, the others crossing). The ``cuda`` case runs where ``torch.cuda.is_available()`` and Horovod was built with CUDA
(``hvd.cuda_built()``): a Horovod built without it (the CPU build of scripts/build_horovod.sh)
refuses CUDA tensors in its own allreduce ("Requested ReadyEvent with GPU device but not
compiled with CUDA"), so the case is skipped there with that reason. A Horovod with NCCL needs
a GPU per rank (NCCL refuses two ranks on one GPU), so on one GPU the case is skipped too. The
``cpu`` case runs the same body everywhere, so the test is proven on a machine without a GPU.
Tolerances: topk, qsgd and dense compute numpy's bits on any device (docs/sparsifiers.md,
docs/quantizers.md), so their result equals the oracle's at every step within 1e-6 (relative,
and 1e-6 x max|result| absolute): the frontend's scaling by 1/P may round once more than the
oracle's division (measured on the CPU: bit for bit at P = 2, 1 ulp at P = 3). PowerSGD's
matmuls on the device round differently (docs/powersgd.md), so its first step, from the same
state, is within 1e-5 x max|result| per weight, and later steps (whose warm-start Q's drift
apart by that rounding) are held to the replicas alone.
"""
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse
from horovod_sparse.exchange.comm import DEVICE_BUFFERS_ENV
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu

hvd = pytest.importorskip("horovod.torch")
import horovod_sparse.torch as hvds  # noqa: E402  (after Horovod is known to be there)

WIDTH = 40  # 40 x 40 = 1600 elements per weight
STEPS = 6
SPECS = ["topk:density=0.05", "qsgd", "powersgd:rank=2", "dense"]


def _cuda_reason():
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    if not hvd.cuda_built():
        return ("Horovod was built without CUDA (hvd.cuda_built() is False): its allreduce refuses CUDA "
                "tensors; build it with HOROVOD_GPU=CUDA (scripts/cuda_check.sh, CUDA_CHECK_BUILD_HOROVOD=1)")
    if hvd.nccl_built() and torch.cuda.device_count() < hvd.local_size():
        return (f"{hvd.local_size()} ranks on this node and {torch.cuda.device_count()} GPU(s): Horovod's NCCL "
                "refuses two ranks on one GPU (ncclCommInitRank: invalid usage, seen on one H100)")
    return None


DEVICES = [pytest.param("cpu", id="cpu"),
           # CPU tensors through the code a CUDA tensor runs (HOROVOD_SPARSE_KERNELS=torch), at 2 and 3
           pytest.param("cpu-device-path", id="cpu-device-path", marks=pytest.mark.world_sizes(2, 3)),
           # and with the payloads handed to mpi4py as they are (HOROVOD_SPARSE_DEVICE_BUFFERS=on),
           # as a GPU's go to an MPI with CUDA support
           pytest.param("cpu-device-buffers", id="cpu-device-buffers", marks=pytest.mark.world_sizes(2, 3)),
           # on rank 0 only: the ranks need not agree (the same bytes go on the wire either way)
           pytest.param("cpu-device-buffers-rank0", id="cpu-device-buffers-rank0", marks=pytest.mark.world_sizes(2, 3)),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda,
                                                  pytest.mark.skipif(_cuda_reason() is not None,
                                                                     reason=str(_cuda_reason()))])]


def device_of(kind):
    if kind.startswith("cpu"):
        return torch.device("cpu")
    index = hvd.local_rank() % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def make_model(device):
    torch.manual_seed(100 + hvd.rank())  # different on purpose: broadcast_parameters must fix it
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 4)).to(device)


def batch(step, device):
    """Deterministic per-(step, rank) data, made on the CPU and moved: every rank sees its own."""
    g = torch.Generator().manual_seed(10_000 * hvd.rank() + step)
    x = torch.randn(16, WIDTH, generator=g)
    y = (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()
    return x.to(device), y.to(device)


def host(tensor):
    return tensor.detach().cpu().numpy().copy()


class Oracle:
    """The numpy pipeline of ``spec`` over every gradient, by name in sorted order (how the
    frontend lays out one step's out-of-band gradients), averaged over the ranks."""

    def __init__(self, spec, comm, shapes):
        self.comm = comm
        self.layout = GradientLayout([(name, shapes[name], "float32") for name in sorted(shapes)])
        self.pipeline = horovod_sparse.create(spec).make_pipeline(self.layout.n, comm, layout=self.layout)

    def expected(self, grads):
        summed = self.pipeline.step(self.layout.fuse([grads[e.key] for e in self.layout.entries]),
                                    tag=self.layout.tag)
        parts = self.layout.split(np.asarray(summed) / np.float32(self.comm.Get_size()))
        return {e.key: part.copy() for e, part in zip(self.layout.entries, parts)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_training_matches_the_oracle_and_replicas_stay_identical(spec, device, comm,
                                                                 assert_identical_across_ranks, monkeypatch):
    if device.startswith("cpu-device"):
        monkeypatch.setenv(cpu.KERNELS_ENV, "torch")  # the oracle's numpy arrays keep numpy's path
    if device == "cpu-device-buffers" or (device == "cpu-device-buffers-rank0" and hvd.rank() == 0):
        monkeypatch.setenv(DEVICE_BUFFERS_ENV, "on")
    where = device_of(device)
    model = make_model(where)
    compression = hvds.Compression.from_spec(spec, dense_below=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    start = host(torch.cat([p.reshape(-1) for p in model.parameters()]))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    oracle = Oracle(spec, comm, shapes)
    losses = []
    try:
        for step in range(STEPS):
            x, y = batch(step, where)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            local = {name: host(p.grad) for name, p in model.named_parameters()}  # before the exchange
            opt.synchronize()
            reduced = {name: p.grad for name, p in model.named_parameters()}
            for name, grad in reduced.items():
                assert grad.device == where, f"step {step}: {name}'s result is on {grad.device}, not {where}"
            reduced = {name: host(grad) for name, grad in reduced.items()}
            expected = oracle.expected(local)
            if not spec.startswith("powersgd"):
                for name, want in expected.items():
                    np.testing.assert_allclose(reduced[name], want, rtol=1e-6, atol=1e-6 * np.abs(want).max(),
                                               err_msg=f"step {step}: {name}")
            elif step == 0:  # from the same (fresh) state: docs/powersgd.md's bound, per weight
                for name, want in expected.items():
                    error = np.abs(reduced[name] - want).max()
                    assert error <= 1e-5 * np.abs(want).max(), f"step 0: {name} off by {error:.3g}"
            with opt.skip_synchronize():
                opt.step()
            losses.append(loss.item())
    finally:
        oracle.pipeline.close()
    params = host(torch.cat([p.reshape(-1) for p in model.parameters()]))
    assert_identical_across_ranks(params)
    assert np.all(np.isfinite(params)) and np.all(np.isfinite(losses))
    assert not np.array_equal(params, start), "training did not move the parameters"
