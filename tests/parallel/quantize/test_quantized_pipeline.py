"""The quantizers' pipelines, made the way the frontends make them
(``horovod_sparse.create(spec).make_pipeline(n, comm)``), against independent oracles.

Per step: the vector a rank sends is recomputed by the test (grad + old residual with
error feedback, Signum's u = beta * u + grad, else grad); the result must be bitwise
identical on every rank and bitwise equal to the exchange oracle run on every rank's
sent vector (gathered with the test's own Allgather); with error feedback
kept + new residual == sent up to the one rounding of sent - kept; checkpoints
restore bitwise. Fed torch tensors, a pipeline returns tensors bitwise equal to the
numpy pipeline's results and keeps the same state (and checkpoints), and its replicas
agree bitwise across ranks.
"""
import numpy as np
import pytest
from quantize_oracles import RANK, SIZE, ExchangeOracle, gather_rows

import horovod_sparse
from horovod_sparse.exchange import ExchangeError
from horovod_sparse.exchange.seeds import derive_seed
from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.codecs import (BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec,
                                            TernGradCodec)
from horovod_sparse.quantize.onebit_buckets import BucketedOneBitCodec
from horovod_sparse.quantize.pipeline import QuantizedPipeline

N = 1001
# spec -> (codec, error feedback, Signum momentum), written out independently of the compressors
SPECS = {
    "bf16": (BF16Codec(), False, None),
    "qsgd": (QSGDCodec(16, 512), False, None),
    "qsgd:levels=3,bucket_size=10,error_feedback=true,method=allgather": (QSGDCodec(3, 10), True, None),
    "terngrad": (TernGradCodec(), False, None),
    "terngrad:error_feedback=true": (TernGradCodec(), True, None),
    "signsgd": (SignCodec(), False, None),
    "signsgd:method=allgather": (SignCodec(), False, None),
    "signum": (SignCodec(), False, 0.9),
    "signum:momentum=0.5,method=allgather": (SignCodec(), False, 0.5),
    "efsignsgd": (ScaledSignCodec(), True, None),
    "efsignsgd:method=allgather": (ScaledSignCodec(), True, None),
    "onebit": (OneBitCodec(), True, None),
    "onebit:method=allgather": (OneBitCodec(), True, None),
    "onebit:bucket_size=10": (BucketedOneBitCodec(10), True, None),
    "bf16:error_feedback=true": (BF16Codec(), True, None),
    "int4": (Int4Codec(4, 128), True, None),
    "int4:bits=2,bucket_size=10,method=allgather": (Int4Codec(2, 10), True, None),
}


def grad_of(step, rank=RANK, n=N):
    rng = np.random.default_rng(10 * step + rank)
    return (rng.standard_normal(n) * 2.0 ** rng.uniform(-3, 3, n)).astype(np.float32)


def method_of(spec):
    return "allgather" if "method=allgather" in spec else "alltoall"


@pytest.mark.parametrize("spec", SPECS)
def test_pipeline_matches_oracle(comm, assert_identical_across_ranks, spec):
    codec, error_feedback, momentum = SPECS[spec]
    method = method_of(spec)
    # server error feedback is on by default exactly for error feedback + alltoall + a sum code
    oracle = ExchangeOracle(N, codec, method, SIZE,
                            server_error_feedback=error_feedback and method == "alltoall")
    residual = np.zeros(N, np.float32)
    u = np.zeros(N, np.float32)
    with horovod_sparse.create(spec).make_pipeline(N, comm) as pipe:
        assert isinstance(pipe, QuantizedPipeline) and pipe.last is None
        assert (pipe.residual is not None) == error_feedback
        total_bytes = 0
        for step in range(4):
            grad = grad_of(step)
            if momentum is not None:
                u = np.float32(momentum) * u + grad
                sent = u
            else:
                sent = grad + residual if error_feedback else grad
            out = pipe.step(grad, tag=42)
            assert out.dtype == np.float32 and out.shape == (N,)
            assert_identical_across_ranks(out)
            expected = oracle(gather_rows(comm, sent), derive_seed(0, step))
            np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
            if error_feedback:  # what was sent as decoded, only computed when the residual needs it
                kept = oracle.own(sent, RANK, derive_seed(0, step))
                np.testing.assert_array_equal(pipe.last.kept.view(np.uint32), kept.view(np.uint32))
            else:
                assert pipe.last.kept is None
            assert pipe.last.step == step and pipe.step_count == step + 1
            total_bytes += pipe.last.traffic.bytes_sent
            if error_feedback:
                # Conservation: residual = fl(sent - kept), so kept + residual == sent up to
                # that one float32 rounding (<= 2**-24 |sent - kept|).
                kept, new = pipe.last.kept.astype(np.float64), pipe.residual.astype(np.float64)
                assert np.all(np.abs(kept + new - sent) <= 2.0 ** -24 * np.abs(sent - kept))
                residual = pipe.residual.copy()
            if codec.aggregate == "majority":
                signs = np.where(gather_rows(comm, sent) >= 0, 1, -1).sum(axis=0)
                np.testing.assert_array_equal(out, SIZE * np.where(signs >= 0, 1, -1))
        assert pipe.traffic.bytes_sent == total_bytes


@pytest.mark.parametrize("spec", SPECS)
def test_state_dict_round_trip(comm, spec):
    """Save after step 2, load into a fresh pipeline: steps 3..5 are bitwise equal."""
    compressor = horovod_sparse.create(spec)
    with compressor.make_pipeline(N, comm) as a, compressor.make_pipeline(N, comm) as b:
        saved = None
        outs_a = []
        for step in range(5):
            out = a.step(grad_of(step))
            if step >= 2:
                outs_a.append(out)
            if step == 1:
                saved = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.state_dict().items()}
        for key, value in saved.items():
            assert isinstance(value, (int, np.ndarray)), key
        b.load_state_dict(saved)
        assert b.step_count == 2
        for step, expected in zip(range(2, 5), outs_a):
            np.testing.assert_array_equal(b.step(grad_of(step)), expected)
        for key in ("residual", "momentum_buffer", "exchange_server_residual"):
            np.testing.assert_array_equal(a.state_dict()[key], b.state_dict()[key])


def test_bad_grad_on_one_rank_raises_everywhere_and_keeps_state(comm):
    with horovod_sparse.create("onebit").make_pipeline(N, comm) as pipe:
        pipe.step(grad_of(0))
        before = pipe.state_dict()
        grad = grad_of(1)[:-1] if RANK == 0 else grad_of(1)
        with pytest.raises(ExchangeError, match="rank 0"):
            pipe.step(grad)
        after = pipe.state_dict()
        np.testing.assert_array_equal(after["residual"], before["residual"])
        np.testing.assert_array_equal(after["exchange_server_residual"], before["exchange_server_residual"])
        assert pipe.step_count == 1
        with pytest.raises(ExchangeError, match="disagree on tag"):
            pipe.step(grad_of(1), tag=RANK)
        np.testing.assert_array_equal(pipe.residual, before["residual"])


@pytest.mark.parametrize("n", [0, 2])
def test_small_buffers(comm, assert_identical_across_ranks, n):
    """n = 0 and n < P (empty chunks) for every quantizer."""
    for spec in ("bf16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit"):
        with horovod_sparse.create(spec).make_pipeline(n, comm) as pipe:
            for step in range(2):
                out = pipe.step(grad_of(step, n=n))
                assert out.shape == (n,)
                assert_identical_across_ranks(out)


def test_bad_parameters(comm):
    for spec, params, name in [("qsgd", dict(levels=0), "levels"), ("qsgd", dict(bucket_size=-1), "bucket_size"),
                               ("terngrad", dict(method="tree"), "method"),
                               ("signum", dict(momentum=1.5), "momentum"),
                               ("efsignsgd", dict(error_feedback="yes"), "error_feedback")]:
        with pytest.raises(ValueError, match=name):
            horovod_sparse.create(spec, **params)
    with pytest.raises(ValueError, match="momentum"):
        QuantizedPipeline(10, comm, SignCodec(), momentum=0.9, error_feedback=True)
    with pytest.raises(ValueError, match="momentum"):
        QuantizedPipeline(10, comm, SignCodec(), momentum=1.0, error_feedback=False)
    with pytest.raises(ValueError, match="seed"):
        QuantizedPipeline(10, comm, SignCodec(), seed=-1)
    with pytest.raises(ValueError, match="method"):
        QuantizedPipeline(10, comm, SignCodec(), method="ring")
    with pytest.raises(ValueError, match="server_error_feedback"):
        QuantizedPipeline(10, comm, OneBitCodec(), method="allgather", server_error_feedback=True)


# ------------------------------------------------------------------ torch
@pytest.mark.parametrize("spec", SPECS)
def test_torch_pipeline_is_the_numpy_pipeline(comm, assert_identical_across_ranks, spec):
    torch = pytest.importorskip("torch")
    compressor = horovod_sparse.create(spec)
    with compressor.make_pipeline(N, comm) as on_numpy, compressor.make_pipeline(N, comm) as on_torch:
        for step in range(4):
            grad = grad_of(step)
            expected = on_numpy.step(grad, tag=9)
            got = on_torch.step(torch.from_numpy(grad.copy()), tag=9)
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (N,)
            np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
            assert_identical_across_ranks(got.numpy())
            if on_numpy.last.kept is not None:
                np.testing.assert_array_equal(on_torch.last.kept.numpy().view(np.uint32),
                                              on_numpy.last.kept.view(np.uint32))
        for key, value in on_numpy.state_dict().items():
            np.testing.assert_array_equal(np.asarray(on_torch.state_dict()[key]), np.asarray(value))
        # a checkpoint of the torch pipeline resumes a numpy one, and the other way round
        on_numpy.load_state_dict(on_torch.state_dict())
        grad = grad_of(9)
        np.testing.assert_array_equal(on_torch.step(torch.from_numpy(grad.copy())).numpy(), on_numpy.step(grad))


def test_torch_bad_grad_raises_everywhere_and_keeps_state(comm):
    torch = pytest.importorskip("torch")
    with horovod_sparse.create("efsignsgd").make_pipeline(N, comm) as pipe:
        pipe.step(torch.from_numpy(grad_of(0)))
        before = pipe.state_dict()
        grad = torch.from_numpy(grad_of(1))
        if RANK == SIZE - 1:
            grad = grad.to(torch.int32)
        with pytest.raises(ExchangeError, match=f"rank {SIZE - 1}"):
            pipe.step(grad)
        after = pipe.state_dict()
        for key in ("residual", "exchange_server_residual", "step"):  # (the call counter moves on)
            np.testing.assert_array_equal(np.asarray(after[key]), np.asarray(before[key]))
