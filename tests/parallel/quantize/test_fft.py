"""The FFT pipeline (and the ``fft`` compressor) against oracles computed here with numpy + mpi4py.

Oracles: the spectrum is recomputed per chunk with numpy's rfft (float32 in, complex64 out:
numpy >= 2 transforms float32 natively, which is the pipeline's definition); the selection
must be the top-energy coefficients of it (energies in float64 here); the result must be
the inverse FFT of the sum over ranks of every rank's decoded kept spectrum (gathered with
MPI); the residual must conserve acc.
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.exchange import ExchangeError
from horovod_sparse.fft import FFTSparsifier

RANK, SIZE = MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size
N = 5000
CHUNK = 512  # 9 full chunks and a short one (392 elements)


def gradient(step, rank=RANK, n=N):
    """Smooth (low-frequency) structure shared by the ranks plus per-rank noise."""
    rng = np.random.default_rng(100 * step + rank)
    t = np.arange(n)
    smooth = np.sin(2 * np.pi * t / 700.0 + step) + 0.5 * np.cos(2 * np.pi * t / 90.0)
    return (smooth + 0.3 * rng.standard_normal(n)).astype(np.float32)


def chunk_bounds(n=N, chunk=CHUNK):
    starts = list(range(0, n, chunk))
    return [(s, min(s + chunk, n)) for s in starts]


def oracle_spectrum(x):
    """float32 re/im interleaved spectrum, chunk by chunk (float32 transforms), numpy only."""
    parts = [np.fft.rfft(np.asarray(x[a:b], np.float32), norm="ortho") for a, b in chunk_bounds()]
    assert all(part.dtype == np.complex64 for part in parts)
    return np.concatenate(parts).view(np.float32)


def oracle_inverse(spectrum):
    out, offset = [], 0
    coefficients = np.asarray(spectrum, np.float32).view(np.complex64)
    for a, b in chunk_bounds():
        m = (b - a) // 2 + 1
        out.append(np.fft.irfft(coefficients[offset:offset + m], n=b - a, norm="ortho"))
        offset += m
    return np.concatenate(out).astype(np.float32, copy=False)


def oracle_energies(spectrum):
    s = np.asarray(spectrum, np.float64)
    weights = []
    for a, b in chunk_bounds():
        w = np.full((b - a) // 2 + 1, 2.0)
        w[0] = 1
        if (b - a) % 2 == 0:
            w[-1] = 1
        weights.append(w)
    return np.concatenate(weights) * (s[0::2] ** 2 + s[1::2] ** 2)


def summed_spectrum(comm, size, positions, values):
    """Sum over ranks (float64, exact here) of every rank's sparse spectrum."""
    dense = np.zeros(size)
    dense[positions] = values
    total = np.empty(size)
    comm.Allreduce(dense, total)
    return total.astype(np.float32)


def norm_sum(comm, x):
    out = np.empty(1)
    comm.Allreduce(np.array([np.linalg.norm(np.asarray(x, np.float64))]), out)
    return float(out[0])


def test_theta_zero_16_bits_is_the_plain_sum_within_the_bound(comm, assert_identical_across_ranks):
    with FFTSparsifier(N, MPI.COMM_WORLD, theta=0.0, bits=16, chunk_size=CHUNK) as p:
        grad = gradient(0)
        out = p.step(grad)
        assert_identical_across_ranks(out)
        exact = np.empty(N)
        comm.Allreduce(grad.astype(np.float64), exact)
        bound = math.sqrt(2) * (2.0 ** -11 + 2.0 ** -20) * norm_sum(comm, grad)
        error = np.linalg.norm(out - exact)
        assert error <= bound, (error, bound)
        assert p.last.kept_coefficients == p.spectrum.n_coefficients
        assert error > 0  # the codes do round: the bound is not vacuous


@pytest.mark.parametrize("exchange,bits", [("allgather", 8), ("allgather", 4), ("oktopk", 16),
                                           ("oktopk", 8)])
def test_theta_positive_against_oracle(comm, assert_identical_across_ranks, exchange, bits):
    theta = 0.8
    params = dict(tau=2, tau_prime=2) if exchange == "oktopk" else {}
    with FFTSparsifier(N, MPI.COMM_WORLD, theta=theta, bits=bits, chunk_size=CHUNK, exchange=exchange,
                       exchange_params=params) as p:
        size = p.spectrum.size
        residual = np.zeros(N, np.float32)
        for step in range(4):
            grad = gradient(step)
            acc = grad + residual
            out = p.step(grad)
            info = p.last
            assert_identical_across_ranks(out)
            # selection: the top-energy C - floor(theta C) coefficients of acc's spectrum
            c = p.spectrum.n_coefficients
            assert info.theta == theta and info.kept_coefficients == c - math.floor(theta * c)
            spectrum = oracle_spectrum(acc)
            energies = oracle_energies(spectrum)
            chosen = info.indices[0::2] // 2
            assert np.array_equal(info.indices[1::2], 2 * chosen + 1)
            rest = np.setdiff1d(np.arange(c), chosen)
            assert energies[chosen].min() >= energies[rest].max() * (1 - 1e-6)
            # what was sent decodes to the codec's view of the spectrum values
            sent = spectrum[info.indices]
            assert np.all(np.abs(info.sent_values - sent) <= p.codec.relative_error * np.abs(sent)
                          + (info.sent_values == 0) * np.abs(sent))
            # the result: inverse FFT of the sum of every rank's decoded kept spectrum
            oracle_sum = summed_spectrum(comm, size, info.cleared,
                                         info.sent_values[np.isin(info.indices, info.cleared)])
            expected = oracle_inverse(oracle_sum)
            if exchange == "allgather":
                assert np.array_equal(info.cleared, info.indices)
                assert np.array_equal(out.view(np.uint32), expected.view(np.uint32))
            else:  # oktopk re-encodes the selected sums once more (phase 2)
                bound = math.sqrt(2) * (p.codec.relative_error + 2.0 ** -20) * np.linalg.norm(oracle_sum)
                if bits == 8:  # plus what the second code flushes below its windows
                    bound += math.sqrt(2) * 2.0 ** -13 * np.linalg.norm(oracle_sum) * math.sqrt(size)
                assert np.linalg.norm(out - expected) <= bound
            # linearity: the result is the sum of what the ranks kept (time domain)
            kept_sum = np.empty(N)
            comm.Allreduce(info.kept.astype(np.float64), kept_sum)
            if exchange == "allgather":
                assert np.allclose(out, kept_sum, rtol=0, atol=1e-5 * np.abs(kept_sum).max())
            # conservation of the residual
            residual = p.residual.copy()
            assert np.all(np.abs(info.kept + residual - acc)
                          <= 2.0 ** -23 * (np.abs(acc) + np.abs(info.kept)))
            assert np.array_equal(info.kept.view(np.uint32),
                                  oracle_inverse(_dense(size, info.cleared, info.sent_values[
                                      np.isin(info.indices, info.cleared)])).view(np.uint32))


def _dense(size, positions, values):
    out = np.zeros(size, np.float32)
    out[positions] = values
    return out


def test_linear_theta_schedule(assert_identical_across_ranks):
    with FFTSparsifier(N, MPI.COMM_WORLD, theta=0.9, bits=8, chunk_size=CHUNK, theta_schedule="linear",
                       theta_final=0.5, decay_steps=4) as p:
        c = p.spectrum.n_coefficients
        expected = [0.9, 0.8, 0.7, 0.6, 0.5, 0.5]
        for step, theta in enumerate(expected):
            assert abs(p.theta_at(step) - theta) < 1e-12
            out = p.step(gradient(step))
            assert p.last.theta == p.theta_at(step)
            assert p.last.kept_coefficients == c - math.floor(p.theta_at(step) * c)
            assert_identical_across_ranks(out)
    # constant: theta every step, whatever theta_final says when decay_steps is 0
    constant = FFTSparsifier(N, MPI.COMM_WORLD, theta=0.7, theta_final=0.1, decay_steps=0,
                             theta_schedule="linear")
    assert constant.theta_at(0) == constant.theta_at(10 ** 6) == 0.7
    constant.close()
    constant.close()  # idempotent


@pytest.mark.parametrize("exchange", ["allgather", "oktopk"])
def test_state_dict_round_trip_is_bitwise(exchange):
    def make():
        return FFTSparsifier(N, MPI.COMM_WORLD, theta=0.85, bits=8, chunk_size=CHUNK, exchange=exchange,
                             theta_schedule="linear", theta_final=0.6, decay_steps=3,
                             exchange_params=dict(tau=2, tau_prime=3) if exchange == "oktopk" else None)
    with make() as a:
        for step in range(2):
            a.step(gradient(step))
        saved = a.state_dict()
        for value in saved.values():
            assert isinstance(value, (int, np.ndarray, np.integer, np.floating))
        tail = [a.step(gradient(step)) for step in range(2, 5)]
        residual = a.residual.copy()
    with make() as b:
        b.load_state_dict(saved)
        for step, expected in zip(range(2, 5), tail):
            assert np.array_equal(b.step(gradient(step)).view(np.uint32), expected.view(np.uint32))
        assert np.array_equal(b.residual.view(np.uint32), residual.view(np.uint32))


def test_exchange_error_leaves_state_untouched():
    with FFTSparsifier(N, MPI.COMM_WORLD, theta=0.5, chunk_size=CHUNK) as p:
        p.step(gradient(0), tag=7)
        residual, steps = p.residual.copy(), p.step_count
        if SIZE > 1:
            with pytest.raises(ExchangeError, match="tag"):
                p.step(gradient(1), tag=RANK)
            assert np.array_equal(p.residual, residual) and p.step_count == steps


def test_compressor_pipeline_and_no_error_feedback(assert_identical_across_ranks):
    compressor = horovod_sparse.create("fft:theta=0.75,bits=12,chunk_size=512,error_feedback=false")
    assert compressor.out_of_band and compressor.name == "fft"
    assert horovod_sparse.create(compressor.spec).params == compressor.params
    with compressor.make_pipeline(N, MPI.COMM_WORLD) as p:
        for step in range(2):
            out = p.step(gradient(step))
            assert_identical_across_ranks(out)
            assert not np.any(p.residual)
            assert p.last.traffic.payload_bytes_sent > 0 or SIZE == 1
        assert p.traffic.bytes_sent >= p.last.traffic.bytes_sent


@pytest.mark.parametrize("n", [0, 1, 3, 512, 513])
def test_small_and_odd_buffers(assert_identical_across_ranks, n):
    for exchange in ("allgather", "oktopk"):
        with FFTSparsifier(n, MPI.COMM_WORLD, theta=0.5, bits=8, chunk_size=CHUNK, exchange=exchange) as p:
            out = p.step(gradient(0, n=n))
            assert out.shape == (n,) and out.dtype == np.float32
            assert_identical_across_ranks(out)


BAD = [
    (dict(theta=1.0), "theta"), (dict(theta=-0.1), "theta"), (dict(theta=float("nan")), "theta"),
    (dict(bits=7), "bits"), (dict(bits=32), "bits"), (dict(chunk_size=1), "chunk_size"),
    (dict(chunk_size=0), "chunk_size"), (dict(exchange="dsa"), "exchange"),
    (dict(exchange="gtopk"), "exchange"), (dict(theta_final=1.5), "theta_final"),
    (dict(decay_steps=-1), "decay_steps"), (dict(error_feedback=1), "error_feedback"),
]


@pytest.mark.parametrize("params,name", BAD, ids=[str(p) for p, _ in BAD])
def test_bad_parameters(params, name):
    with pytest.raises(ValueError, match=name):
        horovod_sparse.create("fft", **params)
    pipeline_params = dict(params)
    with pytest.raises(ValueError, match=name):
        FFTSparsifier(N, MPI.COMM_WORLD, **pipeline_params)
    with pytest.raises(ValueError, match="theta_schedule"):
        FFTSparsifier(N, MPI.COMM_WORLD, theta_schedule="cosine")


# ------------------------------------------------------------------ torch tensors
# The same pipeline on torch tensors. On CPU it runs numpy's kernels (pocketfft, partition)
# on zero-copy views (numpy_on_cpu, the default): the numpy path's bits exactly. With
# numpy_on_cpu=False it runs torch's own (torch.fft, as on a GPU), whose float32 transforms
# round differently (relative L2 ~1.5e-7 here). Tolerance, from the same state each step:
# * selection: a coefficient chosen by one side only must sit at the threshold, its energy
#   within 1e-4 (relative) of the k-th largest (a near-tie the rounding may swap);
# * when no rank swapped any: ||result - numpy's||_2 <= sqrt(2) (2 eps_code + 2**-20)
#   sum_r ||acc_r||_2, i.e. a value's code may differ by one step (a value at a rounding
#   boundary of the codes), plus the transforms' rounding (measured: ~1.4e-7 relative,
#   1.3e-5 on a step where one code flipped).
import torch  # noqa: E402

from horovod_sparse.ops import host  # noqa: E402


def _pipeline(exchange, numpy_on_cpu=True, bits=8):
    p = FFTSparsifier(N, MPI.COMM_WORLD, theta=0.8, bits=bits, chunk_size=CHUNK, exchange=exchange,
                      exchange_params=dict(tau=2, tau_prime=2) if exchange == "oktopk" else None)
    p.numpy_on_cpu = numpy_on_cpu
    return p


def _numpy(x):
    return x.numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


@pytest.mark.parametrize("exchange", ["allgather", "oktopk"])
def test_torch_input_gives_the_numpy_bits(comm, assert_identical_across_ranks, exchange):
    with _pipeline(exchange) as on_numpy, _pipeline(exchange) as on_torch:
        for step in range(4):
            grad = gradient(step)
            expected = on_numpy.step(grad)
            got = on_torch.step(torch.from_numpy(grad.copy()))
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
            assert np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))
            assert isinstance(on_torch.residual, torch.Tensor)
            assert np.array_equal(on_torch.residual.numpy().view(np.uint32), on_numpy.residual.view(np.uint32))
            mine, theirs = on_torch.last, on_numpy.last
            for field in ("kept", "indices", "sent_values", "cleared"):
                assert isinstance(getattr(mine, field), torch.Tensor), field
                assert np.array_equal(_numpy(getattr(mine, field)), getattr(theirs, field)), field
            assert mine.traffic == theirs.traffic and mine.kept_coefficients == theirs.kept_coefficients
            assert_identical_across_ranks(got.numpy())
        a, b = on_numpy.state_dict(), on_torch.state_dict()
        assert set(a) == set(b)
        assert all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a)


def test_torch_kernels_agree_with_numpy(comm, assert_identical_across_ranks):
    with _pipeline("allgather", bits=16) as on_numpy, _pipeline("allgather", False, bits=16) as on_torch:
        compared = 0
        for step in range(6):
            state = on_numpy.state_dict()
            on_torch.load_state_dict(state)  # the same start: one step's difference
            grad = gradient(step)
            acc = grad + state["residual"]
            expected = on_numpy.step(grad)
            got = on_torch.step(torch.from_numpy(grad.copy()))
            assert_identical_across_ranks(got.numpy())
            # selection: the same coefficients up to near-ties at the threshold
            energies = oracle_energies(oracle_spectrum(acc))
            mine = _numpy(on_torch.last.indices)[0::2] // 2
            theirs = on_numpy.last.indices[0::2] // 2
            kth = energies[theirs].min()
            swapped = np.setxor1d(mine, theirs)
            assert np.all(np.abs(energies[swapped] - kth) <= 1e-4 * kth), swapped
            if comm.allreduce(swapped.size) == 0:
                compared += 1
                bound = math.sqrt(2) * (2 * on_numpy.codec.relative_error + 2.0 ** -20) * norm_sum(comm, acc)
                assert np.linalg.norm(got.numpy() - expected) <= bound
            # conservation with torch's kernels
            kept, residual = _numpy(on_torch.last.kept), _numpy(on_torch.residual)
            assert np.all(np.abs(kept + residual - acc) <= 2.0 ** -23 * (np.abs(acc) + np.abs(kept)))
        assert compared >= 4  # near-ties are rare: most steps compare the results


@pytest.mark.parametrize("exchange", ["allgather", "oktopk"])
def test_only_the_kept_pairs_cross_to_the_host(exchange):
    """With torch input, what leaves torch (host.HOST_TRAFFIC) is the kept pairs (int64
    position + float32 value); what enters is their decoded values, the positions and
    values consumed (oktopk only: allgather consumes all it sent) and the summed pairs."""
    with _pipeline(exchange) as p:
        for step in range(3):
            host.HOST_TRAFFIC.reset()
            p.step(torch.from_numpy(gradient(step)))
            sent, cleared = p.last.indices.numel(), p.last.cleared.numel()
            traffic = host.HOST_TRAFFIC
            assert traffic.bytes_out == 12 * sent
            # the summed pairs: at most every rank's kept pairs (theta = 0.8 keeps 20% of
            # the floats, so at P = 4 their union may outweigh the gradient)
            support = (traffic.bytes_in - 4 * sent - (12 * cleared if exchange == "oktopk" else 0)) / 12
            assert support == int(support) and 0 < support <= SIZE * sent
