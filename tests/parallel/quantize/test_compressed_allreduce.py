"""CompressedAllreduce (alltoall and allgather) for every codec, against independent oracles.

Checks: the result is bitwise identical on every rank and bitwise equal to the oracle
(quantize_oracles: every rank's input gathered with the test's own Allgather, the
exchange redone with numpy); for "allgather" also to the rank-order float32 sum of the
ranks' own decoded contributions; the majority vote equals P * sign(sum of signs);
the payload bytes equal the documented formula exactly; agreement errors raise on every
rank; n = 0, n < P and P = 1 work. With torch tensors as input the exchange runs on
them (result and ``own`` are tensors) and gives bitwise the numpy results, moving only
the codes off the tensor's device (host.HOST_TRAFFIC).
"""
import numpy as np
import pytest
from mpi4py import MPI
from quantize_oracles import RANK, SIZE, ExchangeOracle, gather_rows, payload_bytes_sent

from horovod_sparse.exchange import ExchangeError
from horovod_sparse.exchange.compressed import CompressedAllreduce
from horovod_sparse.exchange.seeds import derive_seed
from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.codecs import (BF16Codec, OneBitCodec, QSGDCodec, ScaledSignCodec, SignCodec,
                                            TernGradCodec)

CODECS = [BF16Codec(), QSGDCodec(), QSGDCodec(levels=3, bucket_size=7), TernGradCodec(), SignCodec(),
          ScaledSignCodec(), OneBitCodec(), Int4Codec(bits=3, bucket_size=7)]
METHODS = ["alltoall", "allgather"]
HEADER_BYTES = 10 * 8  # the agreement header: 10 int64 to each peer


def bits(values):
    """The float32 bit patterns: comparisons that tell -0 from 0 and see NaN payloads."""
    return np.asarray(values, dtype=np.float32).view(np.uint32)


def rank_input(n, call, rank=RANK):
    rng = np.random.default_rng(100 * call + rank)
    return (rng.standard_normal(n) * 2.0 ** rng.uniform(-4, 4, n)).astype(np.float32)


@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1000, 0, 3])
def test_matches_oracle(comm, assert_identical_across_ranks, codec, method, n):
    server = method == "alltoall" and codec.aggregate == "sum" and n == 1000
    oracle = ExchangeOracle(n, codec, method, SIZE, server_error_feedback=server)
    with CompressedAllreduce(n, codec, method=method, server_error_feedback=server) as ex:
        for call in range(3):
            x = rank_input(n, call)
            seed = 1000 + call
            res = ex.allreduce(x, seed=seed, tag=7)
            assert res.values.dtype == np.float32 and res.values.shape == (n,)
            assert_identical_across_ranks(res.values)
            inputs = gather_rows(comm, x)
            np.testing.assert_array_equal(bits(res.values), bits(oracle(inputs, seed)))
            np.testing.assert_array_equal(bits(res.own), bits(oracle.own(x, RANK, seed)))
            if method == "allgather" and codec.aggregate == "sum":
                owns = gather_rows(comm, res.own)
                total = owns[0].copy()
                for row in owns[1:]:
                    total += row
                np.testing.assert_array_equal(bits(res.values), bits(total))
            if codec.aggregate == "majority":
                signs = np.where(inputs >= 0, 1, -1).sum(axis=0)
                np.testing.assert_array_equal(res.values, SIZE * np.where(signs >= 0, 1, -1))
            expected = payload_bytes_sent(codec, method, n, SIZE, RANK)
            assert res.traffic.payload_bytes_sent == expected == ex.payload_bytes_sent()
            assert res.traffic.control_bytes_sent == (SIZE - 1) * HEADER_BYTES
            # What one rank sends, its peers receive: totals balance over ranks.
            sent = comm.allreduce(res.traffic.bytes_sent)
            assert sent == comm.allreduce(res.traffic.bytes_received)
        if server:
            np.testing.assert_array_equal(ex.server_residual, oracle.server[RANK])


@pytest.mark.parametrize("codec", [QSGDCodec(), SignCodec(), OneBitCodec()], ids=repr)
def test_byte_bound_alltoall_vs_allgather(codec):
    """alltoall sends about 2 (P-1)/P of the code, independent of P; allgather (P-1) times it."""
    n = 4096
    whole = codec.nbytes(n)
    with CompressedAllreduce(n, codec, "alltoall") as a, CompressedAllreduce(n, codec, "allgather") as g:
        sent_a = a.allreduce(rank_input(n, 0), seed=1).traffic.payload_bytes_sent
        sent_g = g.allreduce(rank_input(n, 0), seed=1).traffic.payload_bytes_sent
    assert sent_g == (SIZE - 1) * whole
    # Each chunk's header and last partial byte are the only overhead over 2 (P-1)/P.
    overhead = 2 * (SIZE - 1) * (codec.nbytes(0) + 1 + 4 * 1)
    assert 2 * (SIZE - 1) / SIZE * whole - overhead <= sent_a <= 2 * (SIZE - 1) / SIZE * whole + overhead


def test_single_rank_communicator():
    """P = 1 (COMM_SELF): no bytes move; the result is the one-rank oracle's."""
    x = rank_input(100, 0)
    for codec in CODECS:
        for method in METHODS:
            oracle = ExchangeOracle(100, codec, method, 1)
            with CompressedAllreduce(100, codec, method, comm=MPI.COMM_SELF) as ex:
                res = ex.allreduce(x, seed=5)
                assert res.traffic.bytes_sent == res.traffic.bytes_received == 0
                np.testing.assert_array_equal(res.values, oracle(x[None, :], 5))
                if codec.aggregate == "majority":
                    np.testing.assert_array_equal(res.values, np.where(x >= 0, 1, -1))
    # the sum is quantized once, as at P = 2: this rank's code decoded, no owner's re-encoding
    # (its server residual, on by default with error feedback, stays zero)
    for codec in [c for c in CODECS if c.aggregate == "sum"]:
        with CompressedAllreduce(100, codec, "alltoall", comm=MPI.COMM_SELF, server_error_feedback=True) as ex:
            for call in range(2):
                res = ex.allreduce(x, seed=5 + call, want_own=call == 0)
                expected = codec.roundtrip(x, derive_seed(5 + call, 0, 0))
                np.testing.assert_array_equal(bits(res.values), bits(expected))
                np.testing.assert_array_equal(bits(ex.decoded_own()), bits(expected))
                assert res.own is None if call else np.array_equal(bits(res.own), bits(expected))
            assert not ex.server_residual.any()


# ------------------------------------------------------------- agreement
def expect_error_everywhere(run, match):
    with pytest.raises(ExchangeError, match=match):
        run()


def test_mismatched_n_raises_on_every_rank():
    n = 100 + (RANK == 0)
    with CompressedAllreduce(n, QSGDCodec()) as ex:
        expect_error_everywhere(lambda: ex.allreduce(rank_input(n, 0), seed=1), "disagree on n")
        # The next call (now agreed on nothing new) still fails the same way, no hang.
        expect_error_everywhere(lambda: ex.allreduce(rank_input(n, 0), seed=1), "disagree on n")


def test_mismatched_tag_raises_on_every_rank():
    with CompressedAllreduce(100, SignCodec(), "allgather") as ex:
        expect_error_everywhere(lambda: ex.allreduce(rank_input(100, 0), seed=1, tag=int(RANK == 1)),
                                "disagree on tag")
        res = ex.allreduce(rank_input(100, 0), seed=1, tag=3)  # the exchange still works
        assert res.values.shape == (100,)


def test_mismatched_codec_or_method_raises_on_every_rank():
    codec = QSGDCodec(levels=4 if RANK == SIZE - 1 else 8)
    with CompressedAllreduce(50, codec) as ex:
        expect_error_everywhere(lambda: ex.allreduce(rank_input(50, 0), seed=1), "disagree on params")
    method = METHODS[RANK % 2]
    with CompressedAllreduce(50, BF16Codec(), method) as ex:
        expect_error_everywhere(lambda: ex.allreduce(rank_input(50, 0), seed=1), "disagree on algorithm")


@pytest.mark.parametrize("bad", ["length", "dtype", "ndim", "tag", "seed"])
def test_bad_input_on_one_rank_raises_on_every_rank(bad):
    x, seed, tag = rank_input(64, 0), 3, 0
    if RANK == SIZE - 1:
        if bad == "length":
            x = x[:-1]
        elif bad == "dtype":
            x = np.arange(64)
        elif bad == "ndim":
            x = x.reshape(8, 8)
        elif bad == "tag":
            tag = 2 ** 70
        else:
            seed = 1.5
    with CompressedAllreduce(64, TernGradCodec()) as ex:
        expect_error_everywhere(lambda: ex.allreduce(x, seed=seed, tag=tag), f"rank {SIZE - 1}")
        assert ex.calls == 1


def test_bad_constructor_parameters():
    with pytest.raises(ValueError, match="method"):
        CompressedAllreduce(10, SignCodec(), method="ring")
    with pytest.raises(ValueError, match="n must"):
        CompressedAllreduce(-1, SignCodec())
    with pytest.raises(ValueError, match="codec"):
        CompressedAllreduce(10, object())
    with pytest.raises(ValueError, match="server_error_feedback"):
        CompressedAllreduce(10, QSGDCodec(), method="allgather", server_error_feedback=True)
    with pytest.raises(ValueError, match="server_error_feedback"):
        CompressedAllreduce(10, SignCodec(), server_error_feedback=True)


def test_state_dict_restores_server_residual_and_calls(assert_identical_across_ranks):
    codec, n = OneBitCodec(), 500
    with CompressedAllreduce(n, codec, server_error_feedback=True) as a, \
            CompressedAllreduce(n, codec, server_error_feedback=True) as b:
        a.allreduce(rank_input(n, 0), seed=1)
        state = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in a.state_dict().items()}
        b.load_state_dict(state)
        for call in (1, 2):
            ra, rb = a.allreduce(rank_input(n, call), seed=call), b.allreduce(rank_input(n, call), seed=call)
            np.testing.assert_array_equal(ra.values, rb.values)
        np.testing.assert_array_equal(a.server_residual, b.server_residual)
        assert a.calls == b.calls == 3


# ------------------------------------------------------------------ torch
@pytest.mark.parametrize("codec", CODECS, ids=repr)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("n", [1000, 2])
def test_torch_input_gives_the_numpy_result(assert_identical_across_ranks, codec, method, n):
    torch = pytest.importorskip("torch")
    from horovod_sparse.ops.host import HOST_TRAFFIC
    server = method == "alltoall" and codec.aggregate == "sum"
    twin = type(codec).__new__(type(codec))
    twin.__dict__.update(codec.__getstate__())  # the same code, its own scratch buffers
    with CompressedAllreduce(n, codec, method, server_error_feedback=server) as on_numpy, \
            CompressedAllreduce(n, twin, method, server_error_feedback=server) as on_torch:
        for call in range(3):
            x = rank_input(n, call)
            expected = on_numpy.allreduce(x, seed=call, tag=5)
            HOST_TRAFFIC.reset()
            got = on_torch.allreduce(torch.from_numpy(x.copy()), seed=call, tag=5)
            assert isinstance(got.values, torch.Tensor) and isinstance(got.own, torch.Tensor)
            np.testing.assert_array_equal(bits(got.values.numpy()), bits(expected.values))
            np.testing.assert_array_equal(bits(got.own.numpy()), bits(expected.own))
            assert_identical_across_ranks(got.values.numpy())
            assert got.traffic == expected.traffic
            # only codes crossed: the chunks' codes out and back, the owner's code out and back
            # (P = 2: every chunk's code out, the peer's codes back)
            whole = sum(on_torch.chunk_nbytes)
            if method == "allgather":
                crossed = codec.nbytes(n) * (1 + SIZE)
            elif SIZE == 2:
                crossed = 2 * whole
            else:
                crossed = 2 * whole + (SIZE + 1) * on_torch.chunk_nbytes[RANK]
            assert HOST_TRAFFIC.bytes == crossed
        if server:
            residual = on_torch.server_residual  # at P = 2 never used, so never moved to torch
            residual = residual.numpy() if isinstance(residual, torch.Tensor) else residual
            np.testing.assert_array_equal(bits(residual), bits(on_numpy.server_residual))
            for key, value in on_numpy.state_dict().items():
                np.testing.assert_array_equal(on_torch.state_dict()[key], value)
