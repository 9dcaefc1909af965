"""Device buffers handed to MPI as they are (``HOROVOD_SPARSE_DEVICE_BUFFERS``,
``exchange/comm.py``): the choice and its refusal of other names, what the MPI library says, and
one rank's steps through the path on the CPU (``on`` with the device path: CPU tensors go to
mpi4py through DLPack as a GPU's would with an MPI that has CUDA support), which must give the
crossing path's bits with nothing crossing. The exchanges at P = 2 and 3, and training, are in
tests/parallel/torch/ (test_device_counts.py, test_cuda_training.py)."""
import subprocess

import numpy as np
import pytest
import torch
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.exchange import comm as comm_module
from horovod_sparse.exchange.comm import CountingComm
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu, host


@pytest.fixture
def counting_comm():
    c = CountingComm(MPI.COMM_SELF)
    yield c
    c.close()


def test_the_choice_defaults_to_auto_and_reads_other_names_as_auto(monkeypatch):
    monkeypatch.delenv(comm_module.DEVICE_BUFFERS_ENV, raising=False)
    assert comm_module.device_buffers_chosen() == "auto"
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, " ON ")
    assert comm_module.device_buffers_chosen() == "on"
    # mid-step, a rank cannot raise alone: the exchange's agreement refuses it on every rank
    # (tests/unit/test_switches.py)
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "cuda")
    assert comm_module.device_buffers_chosen() == "auto"


def test_an_mpi_built_without_cuda_does_not_report_it():
    try:
        info = subprocess.run(["ompi_info", "--parsable", "--all"], capture_output=True, text=True, timeout=60).stdout
    except FileNotFoundError:
        pytest.skip("no ompi_info: not Open MPI")
    built = [line for line in info.splitlines() if "built_with_cuda_support:value:" in line]
    if not built or not built[0].endswith(":false"):
        pytest.skip(f"this Open MPI says {built[:1]}: whether CUDA is usable at run time is the GPU check's")
    assert comm_module.mpi_reports_cuda_support() is False


def test_the_doctor_says_how_a_cuda_payload_goes(monkeypatch):
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "off")
    assert comm_module.cuda_payload_route() == "through pinned host memory (HOROVOD_SPARSE_DEVICE_BUFFERS=off)"
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "on")
    assert comm_module.cuda_payload_route() == "handed to MPI as device buffers (HOROVOD_SPARSE_DEVICE_BUFFERS=on)"
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "auto")
    assert comm_module.cuda_payload_route() == (
        "handed to MPI as device buffers (HOROVOD_SPARSE_DEVICE_BUFFERS=auto)" if comm_module.mpi_reports_cuda_support()
        else "through pinned host memory (this MPI reports no CUDA support)")


def test_which_tensors_are_handed_over(monkeypatch, counting_comm):
    t = torch.zeros(4)
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "auto")
    assert not counting_comm.takes_device_buffer(t)  # a CPU tensor, and no CUDA support asked for
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "on")
    assert counting_comm.takes_device_buffer(t)
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "off")
    assert not counting_comm.takes_device_buffer(t)


def test_to_wire_hands_over_only_a_tensor_that_would_cross(monkeypatch, counting_comm):
    monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, "on")
    t = torch.arange(6, dtype=torch.float32)[::2]  # strided: handed over contiguous
    assert isinstance(host.to_wire(t, counting_comm), np.ndarray)  # the host's path: a zero-copy view
    with cpu.device_path():
        host.HOST_TRAFFIC.reset()
        wired = host.to_wire(t, counting_comm)
        assert isinstance(wired, torch.Tensor) and wired.is_contiguous() and wired.tolist() == [0, 2, 4]
        summed = counting_comm.allreduce(wired)
        assert isinstance(summed, torch.Tensor) and summed.tolist() == [0, 2, 4]
        assert host.from_wire(summed, t) is summed
        snap = host.HOST_TRAFFIC.snapshot()
        assert (snap["transfers_out"], snap["transfers_in"], snap["handed_out"], snap["handed_in"]) == (0, 0, 1, 1)


def test_the_collectives_receive_beside_a_handed_buffer(monkeypatch, counting_comm):
    codes = torch.arange(5, dtype=torch.uint8)
    gathered = counting_comm.allgatherv(codes, [5])
    assert isinstance(gathered, torch.Tensor) and gathered.dtype == torch.uint8 and gathered.tolist() == list(range(5))
    received = counting_comm.alltoallv(codes, [5], [5])
    assert isinstance(received, torch.Tensor) and received.tolist() == list(range(5))
    assert isinstance(counting_comm.allgatherv(codes.numpy(), [5]), np.ndarray)  # numpy stays numpy


def _cuda_reason():
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not comm_module.mpi_reports_cuda_support():
        return "this MPI does not report CUDA support (MPIX_Query_cuda_support)"
    return None


DEVICES = [pytest.param("cpu", id="cpu"),  # the device path, its CPU tensors handed over ("on")
           pytest.param("cuda", id="cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
               _cuda_reason() is not None, reason=str(_cuda_reason()))])]  # "auto": MPI says it takes them


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", ["dense", "powersgd:rank=2", "qsgd"])
def test_one_ranks_steps_give_the_crossing_paths_bits_with_nothing_crossing(spec, device, monkeypatch):
    """Three steps of one pipeline with the payloads handed over, against a fresh pipeline whose
    payloads cross: the same results and checkpoint bit for bit; in the steady steps of the
    handed path no transfer either way (PowerSGD's Q sum stays on the device until the
    checkpoint reads it)."""
    shapes = [(24, 16), (16,), (16, 8)]
    n = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng(5)
    grads = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(device) for _ in range(3)]
    grads[0].zero_()  # PowerSGD's first Q sum then has zero columns: redrawn on the host's path
    monkeypatch.setenv("HOROVOD_SPARSE_WARMUP_STEPS", "0")  # compressed steps, not a warm-up's dense ones
    results = {}
    for choice in ("off", "on" if device == "cpu" else "auto"):
        monkeypatch.setenv(comm_module.DEVICE_BUFFERS_ENV, choice)
        layout = GradientLayout([(f"p{i}", s, "float32") for i, s in enumerate(shapes)])
        with cpu.device_path(), horovod_sparse.create(spec).make_pipeline(n, MPI.COMM_SELF, layout=layout) as pipeline:
            results[choice] = []
            for step, g in enumerate(grads):
                if step == 1:  # steady steps: PowerSGD's first uploads its start Q's, drawn on the host
                    host.HOST_TRAFFIC.reset()
                results[choice].append(pipeline.step(g.clone(), tag=layout.tag).clone())
            results[choice + " traffic"] = host.HOST_TRAFFIC.snapshot()
            results[choice + " state"] = pipeline.state_dict()  # PowerSGD's Q's: brought down now
    handed = "on" if device == "cpu" else "auto"
    for step, (got, crossed) in enumerate(zip(results[handed], results["off"])):
        assert torch.equal(got, crossed), f"{spec} step {step}: the handed path's result differs"
    assert results[handed + " state"].keys() == results["off state"].keys()
    for key, value in results["off state"].items():
        assert np.array_equal(np.asarray(results[handed + " state"][key]), np.asarray(value)), (spec, key)
    on = results[handed + " traffic"]
    if spec != "qsgd":  # one rank's quantizer exchange calls no collective
        assert on["handed_out"] >= 2 and on["handed_in"] >= 2, on
    assert on["transfers_in"] == 0 and on["transfers_out"] == 0, on
