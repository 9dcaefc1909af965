"""The FFT compressor as TensorFlow ops on the gradients' device, checked on the CPU.

On a GPU, or with ``compression.on_device = True``, the TensorFlow frontend runs the FFT
pipeline's step on the fused float32 tensor as TensorFlow ops (error feedback, the chunked
``tf.signal.rfft``, energy keys, the exact top-k of the coefficients, the residual update and
the ``tf.signal.irfft`` of the summed spectrum); only the kept (position, value) pairs cross to
numpy for the exchange (which makes the range codes), and the summed pairs come back.

A documented tolerance, not bit for bit: ``tf.signal``'s float32 FFT is not numpy's
(pocketfft) bit for bit. Both compute an orthonormal transform of a chunk of L <= 256 elements
with a relative L2 error of order eps * log2(L) (eps = 2**-24; measured here ~1e-7, bounded by
log2(256) * 2**-24 = 2**-21 per transform), so the two paths' results may differ by twice that:
``FFT_RTOL = 2**-20`` in relative L2. Everything after the transform is exact integer logic
(keys, selection, positions) or IEEE arithmetic on the same inputs (codes, sums), so the tests
make those inputs agree: each rank's gradient is the inverse transform of a spectrum with
exactly k strong coefficients (k = what theta keeps) whose values are exactly representable by
the codes, plus noise far below the codes' rounding boundaries. Then the FFT's rounding can
neither move a coefficient across the selection threshold nor a value across a code boundary,
and the tests assert what is meaningful, exactly where it must be exact:

- the same positions and the same decoded values sent as the numpy path, the same payload
  sizes, at every step (no tolerance);
- the result within ``FFT_RTOL`` (relative L2) of the numpy path and of an independent float64
  oracle (the inverse transform of the exact sum of the ranks' strong spectra: the sum the codes
  carry; for "oktopk" that sum coded again), the residual within FFT rounding of the numpy
  path's;
- the result bitwise identical on every rank (the same summed pairs through the same ops);
- per step, only the payload crosses to numpy (:data:`~horovod_sparse.ops.host.HOST_TRAFFIC`).
"""
import math

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.host import HOST_TRAFFIC

from device_steps import run_gradients  # tests/parallel/tensorflow


SHAPES = [(64, 40), (300,), (50, 30)]  # 4360 elements fused, a 1-D gradient among them
STEPS = 6
#: relative L2 difference allowed between two float32 FFT implementations (module docstring)
FFT_RTOL = 2.0**-20
#: magnitudes of the strong coefficients' re/im: three mantissa bits, exact in every code width
GRID = np.array([1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5])
#: time-domain noise (per-coefficient too, the transform is orthonormal): far below half a code
#: step of the strong values (2**-4 at 8 bits, 2**-8 at 12) and far above FFT rounding
NOISE = 1e-4
SPECS = ["fft:chunk_size=256", "fft:chunk_size=255,bits=12", "fft:chunk_size=256,exchange=oktopk",
         "fft:chunk_size=200,error_feedback=False"]


def run(spec, on_device, targets, per_step=None):
    """The gradients ``targets`` (per step, per shape) through DistributedGradientTape; returns
    the compression and each step's results. ``per_step(i, pipeline)`` after each step."""
    return run_gradients(spec, on_device, targets, SHAPES, per_step=None if per_step is None else (
        lambda i, compression: per_step(i, compression.step_pipelines.pipeline)))


def chunks(n, chunk_size):
    """(start, length, first coefficient) of each chunk of a buffer of n elements."""
    offset = 0
    for start in range(0, n, chunk_size):
        length = min(chunk_size, n - start)
        yield start, length, offset
        offset += length // 2 + 1


def irfft_chunked(spectrum, n, chunk_size):
    """float64 inverse of a complex chunked "ortho" spectrum (the oracle's transform)."""
    out = np.empty(n)
    for start, length, first in chunks(n, chunk_size):
        out[start:start + length] = np.fft.irfft(spectrum[first:first + length // 2 + 1], length, norm="ortho")
    return out


def strong_targets(reference, layout, chunk_size, seed):
    """Per step: each rank's gradients (by shape) and its strong spectrum (complex128, the
    coefficients kept). The strong positions are the same on every rank (so "oktopk"'s global
    selection keeps them all), their values differ by rank."""
    n, count = layout.n, reference.spectrum.n_coefficients
    real_only = np.zeros(count, bool)  # DC and, for an even chunk, Nyquist: no imaginary part
    for _, length, first in chunks(n, chunk_size):
        real_only[first] = True
        real_only[first + length // 2] |= length % 2 == 0
    shared, own = np.random.default_rng(seed), np.random.default_rng(seed + 1000 * (1 + hvd.rank()))
    steps = []
    for step in range(STEPS):
        positions = shared.choice(count, reference.kept_for(step), replace=False)
        values = own.choice(GRID, (positions.size, 2)) * own.choice([-1.0, 1.0], (positions.size, 2))
        values[real_only[positions], 1] = 0
        strong = np.zeros(count, complex)
        strong[positions] = values[:, 0] + 1j * values[:, 1]
        fused = (irfft_chunked(strong, n, chunk_size) + NOISE * own.standard_normal(n)).astype(np.float32)
        steps.append((layout.split(fused), strong))
    return steps


def summed_spectrum(summed, pipeline):
    """The spectrum the exchange delivers for the exact sum ``summed`` of the ranks' strong
    spectra (each rank's values are exact codes, their sum is exact in float32): "allgather"
    sums the decoded values, "oktopk" sends the sums coded again (each value rounded on its own:
    every sum lies inside its block's window)."""
    if pipeline.exchange != "oktopk":
        return summed
    pairs = np.stack([summed.real, summed.imag], axis=1).astype(np.float32).reshape(-1)
    coded = pipeline.codec.roundtrip(pairs).astype(np.float64).reshape(-1, 2)
    return coded[:, 0] + 1j * coded[:, 1]


def relative_l2(got, want):
    return float(np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want))


@pytest.mark.parametrize("spec", SPECS)
def test_tensorflow_ops_agree_with_the_numpy_path_and_the_oracle(spec, comm, assert_identical_across_ranks):
    layout = GradientLayout([(i, s, "float32") for i, s in enumerate(SHAPES)])
    chunk_size = horovod_sparse.create(spec).chunk_size
    with horovod_sparse.create(spec).make_pipeline(layout.n, comm, layout=layout) as reference:
        data = strong_targets(reference, layout, chunk_size, seed=5)
    targets = [[g.reshape(s) for g, s in zip(gradients, SHAPES)] for gradients, _ in data]
    seen = {False: [], True: []}

    def recorder(on_device):
        def record(i, pipeline):
            last = pipeline.last
            seen[on_device].append(dict(  # copies: the numpy path reuses its buffers
                indices=np.array(last.indices), sent=np.array(last.sent_values),
                cleared=np.array(last.cleared), kept=last.kept_coefficients,
                payload=last.traffic.payload_bytes, residual=np.array(pipeline.memory.residual)))
        return record

    _, on_numpy = run(spec, False, targets, recorder(False))
    compression, on_device = run(spec, True, targets, recorder(True))
    pipeline = compression.step_pipelines.pipeline
    if pipeline.error_feedback:
        assert isinstance(pipeline.memory.residual, tf.Tensor), \
            "the residual lives in TensorFlow: the step ran as TensorFlow ops"
    drift = 0.0  # bound on the residuals' difference: FFT rounding of each step's acc
    for i, ((fused, strong), numpy_result, device_result, a, b) in enumerate(
            zip(data, on_numpy, on_device, seen[False], seen[True])):
        where = f"{spec} step {i}"
        # the payload: exactly what the numpy path sends (exact selection, exact codes)
        assert a["kept"] == b["kept"] == reference.kept_for(i), where
        np.testing.assert_array_equal(b["indices"], a["indices"], err_msg=where)
        np.testing.assert_array_equal(b["sent"], a["sent"], err_msg=where)
        np.testing.assert_array_equal(b["cleared"], a["cleared"], err_msg=where)
        assert b["payload"] == a["payload"], where
        np.testing.assert_array_equal(b["cleared"], b["indices"], err_msg=f"{where}: all strong ones consumed")
        # the result: within FFT rounding of the numpy path and of the oracle, the same on every rank
        got, numpy_fused = layout.fuse(device_result), layout.fuse(numpy_result)
        want = irfft_chunked(summed_spectrum(comm.allreduce(strong), pipeline), layout.n, chunk_size) / comm.size
        assert relative_l2(got, numpy_fused) <= FFT_RTOL, where
        assert relative_l2(got, want) <= FFT_RTOL, where
        assert relative_l2(numpy_fused, want) <= FFT_RTOL, where
        for result in device_result:
            assert_identical_across_ranks(result)
        # the residual: each path's acc - irfft(kept) differs by the transforms' rounding of acc
        drift += 2 * FFT_RTOL * float(np.linalg.norm(layout.fuse(fused)))
        if pipeline.error_feedback:
            assert np.linalg.norm(b["residual"] - a["residual"]) <= drift, where
            assert np.linalg.norm(b["residual"]) < 10 * NOISE * math.sqrt(layout.n), f"{where}: only noise left"


@pytest.mark.parametrize("spec", ["fft:theta=0.95", "fft:theta=0.95,exchange=oktopk"])
def test_only_the_payload_leaves_tensorflow(spec, comm):
    """Per step: out go this rank's kept pairs (int64 position + float32 value, re and im of each
    kept coefficient), back come its decoded values and the summed pairs. Never a
    gradient-sized transfer."""
    n = sum(math.prod(s) for s in SHAPES)

    def check(i, pipeline):
        last = pipeline.last
        sent = int(last.indices.shape[0])
        assert sent == 2 * last.kept_coefficients == 2 * pipeline.kept_for(i)
        assert HOST_TRAFFIC.bytes_out == sent * (8 + 4), f"step {i}: only the kept pairs leave"
        assert 0 < HOST_TRAFFIC.bytes_in <= (comm.size + 2) * sent * (8 + 4), \
            f"step {i}: only the decoded and summed pairs return"
        assert HOST_TRAFFIC.largest <= comm.size * sent * 8 < n * 4 / 2, f"step {i}: no gradient-sized transfer"
        assert isinstance(pipeline.memory.residual, tf.Tensor)

    rng = np.random.default_rng(11 + 1000 * hvd.rank())
    run(spec, True, [[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)],
        per_step=check)
