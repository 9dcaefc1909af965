"""Quantizers, PowerSGD and FFT behind the stock hvd.DistributedOptimizer.

Their math and exchanges are checked against numpy oracles in tests/parallel/quantize;
here the oracle is that math itself: the PyTorch frontend must hand Horovod's optimizer
exactly what an independent numpy pipeline computes from the same fused gradients.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.layout import GradientLayout

from test_sparsifiers import SHAPES, demo_model_bytes, exchange, flat_parameters, train

pytestmark = pytest.mark.world_sizes(2, 3)  # the frontend's oracles at an odd count (each rank's share of the average)

SPECS = ["bf16", "qsgd", "qsgd:method=allgather", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
         "onebit:bucket_size=64", "powersgd:rank=2", "fft", "fft:exchange=oktopk"]
#: run with plain SGD: compressors that apply momentum themselves, and signSGD by definition
OWN_MOMENTUM = ("signum", "signsgd")  # signSGD is plain SGD on signs; Signum has its own momentum
#: learning rates other than 0.05: the sign methods move every coordinate by lr each step (their
#: papers use 1e-3 .. 1e-4), TernGrad's unclipped ternary codes are noisy
LEARNING_RATE = {"signsgd": 0.002, "signum": 0.002, "terngrad": 0.01}


def make(spec):
    torch.manual_seed(100 + hvd.rank())
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    compression = hvds.Compression.from_spec(spec, dense_below=100)
    name = spec.split(":")[0]
    opt = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE.get(name, 0.05),
                          momentum=0.0 if name in OWN_MOMENTUM else 0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt, compression


@pytest.mark.parametrize("spec", SPECS)
def test_frontend_hands_horovod_what_the_numpy_pipeline_computes(spec, comm, average_across_ranks,
                                                                 assert_identical_across_ranks):
    compressor = hvds.Compression.from_spec(spec, dense_below=64)
    big = [(position, s) for position, s in enumerate(SHAPES) if int(np.prod(s)) >= 64]
    layout = GradientLayout([(position, s, "float32") for position, s in big])
    with horovod_sparse.create(spec).make_pipeline(layout.n, comm, layout=layout) as reference:
        rng = np.random.default_rng(500 + hvd.rank())
        for _ in range(3):
            grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            results = exchange(compressor, [torch.from_numpy(g) for g in grads])
            expected = layout.split(reference.step(layout.fuse([grads[p] for p, _ in big]), tag=layout.tag)
                                    / np.float32(hvd.size()))
            for grad, result in zip(grads, results):
                assert result.shape == grad.shape and result.dtype == torch.float32
                want = expected.pop(0) if grad.size >= 64 else average_across_ranks(grad)
                np.testing.assert_allclose(result.numpy(), want, rtol=1e-6, atol=1e-6)
                assert_identical_across_ranks(result.numpy())


# at the odd count only, where ranks' shares and exchanges differ most (TensorFlow's run at 2)
@pytest.mark.world_sizes(3)
@pytest.mark.parametrize("spec", SPECS)
def test_replicas_bitwise_identical_after_100_steps(spec, assert_identical_across_ranks):
    model, opt, compression = make(spec)
    start = flat_parameters(model).copy()
    losses = train(model, opt, range(100))
    params = flat_parameters(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start)
    assert np.all(np.isfinite(params))
    assert np.mean(losses[-20:]) < np.mean(losses[:20]), f"{spec}: loss did not go down"


@pytest.mark.parametrize("spec", ["qsgd", "efsignsgd", "powersgd:rank=2", "fft:exchange=oktopk"])
def test_checkpoint_resume_is_bitwise_identical(spec):
    model, opt, compression = make(spec)
    train(model, opt, range(6))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "compression": compression.state_dict()})
    train(model, opt, range(6, 15))
    uninterrupted = flat_parameters(model).copy()

    model2, opt2, compression2 = make(spec)
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    compression2.load_state_dict(checkpoint["compression"])
    train(model2, opt2, range(6, 15))
    np.testing.assert_array_equal(flat_parameters(model2), uninterrupted)


# Bits per weight value on the wire, and the exchange's factor (bytes sent per rank for a
# vector of B bytes): alltoall sends ~2(P-1)/P B like the ring, allgather (P-1) B.
N_WEIGHTS, N_SMALL = 64 * 128 + 128 * 10, 128 + 10


def ring(P):
    return 2 * (P - 1) / P


@pytest.mark.parametrize("spec, bits", [("bf16", 16), ("qsgd", 6), ("terngrad", 2), ("signsgd", 1),
                                        ("efsignsgd", 1), ("onebit", 1)])
def test_quantizer_bytes_follow_their_bit_width(spec, bits):
    """Sent bytes = the codes (bits per value, rounded up per chunk, plus per-chunk headers of at
    most 64 bytes) through the alltoall exchange, plus Horovod's ring share for biases and probes."""
    sent, dense_ring = demo_model_bytes(spec, steps=5)
    P = hvd.size()
    codes = ring(P) * (N_WEIGHTS * bits / 8 + 64 * P)
    horovod = ring(P) * (N_SMALL + 2) * 4
    assert sent <= codes + horovod + 128 * P, f"{spec}: {sent:.0f} B/step, bound {codes + horovod:.0f}"
    assert sent * (32 / bits) * 0.5 <= dense_ring, f"{spec}: {sent:.0f} vs dense {dense_ring:.0f}"


def test_powersgd_bytes_are_the_low_rank_factors():
    sent, dense_ring = demo_model_bytes("powersgd:rank=2", steps=5)
    P, r = hvd.size(), 2
    factors = r * (64 + 128) + r * (128 + 10)  # both weight matrices are compressed at rank 2
    bound = ring(P) * factors * 4 + ring(P) * (N_SMALL + 2) * 4 + 256 * P
    assert sent <= bound, f"powersgd: {sent:.0f} B/step, bound {bound:.0f}"
    assert sent * 10 <= dense_ring


@pytest.mark.parametrize("spec", ["bf16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
                                  "qsgd:method=allgather"])
def test_quantizers_run_on_torch_and_only_codes_leave_it(spec, assert_identical_across_ranks):
    """Behind the frontend the pipeline gets the fused buffer as a torch tensor and computes on
    it: what crosses to the host (host.HOST_TRAFFIC) is exactly the codes of the step's
    compressed allreduce, and the results agree bitwise across ranks."""
    from horovod_sparse.ops.host import HOST_TRAFFIC
    compressor = hvds.Compression.from_spec(spec, dense_below=64)
    rng = np.random.default_rng(700 + hvd.rank())
    for _ in range(2):
        grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
        HOST_TRAFFIC.reset()
        results = exchange(compressor, grads)
        crossed = HOST_TRAFFIC.bytes
        (_, pipeline), = compressor.pipelines.values()
        ex = pipeline.exchange
        if ex.method == "allgather":
            codes = ex.codec.nbytes(ex.n) * (1 + hvd.size())
        elif hvd.size() == 2:  # one Allgatherv of every chunk's code; only the peer's comes back
            codes = 2 * sum(ex.chunk_nbytes)
        else:
            codes = 2 * sum(ex.chunk_nbytes) + (hvd.size() + 1) * ex.chunk_nbytes[ex.rank]
        assert crossed == codes, f"{spec}: {crossed} bytes crossed, the codes are {codes}"
        for result in results:
            assert_identical_across_ranks(result.numpy())
