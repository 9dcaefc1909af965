"""The compiled CPU kernels of PowerSGD and FFT (horovod_sparse.ops.cpu.lowrank and .spectrum)
against the numpy path they replace, bit for bit: each kernel on random and adversarial
inputs, then whole pipelines (P = 1) over several steps with the kernels on and off."""
import contextlib

import numpy as np
import pytest
import torch
from mpi4py import MPI

from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.fft import FFTSparsifier
from horovod_sparse.fft.spectrum import ChunkedSpectrum
from horovod_sparse.layout import GradientLayout
from horovod_sparse.lowrank import PowerSGDPipeline
from horovod_sparse.lowrank.factors import expand
from horovod_sparse.ops import cpu
from horovod_sparse.ops.finite import all_finite

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")

if cpu.available():
    from horovod_sparse.ops.cpu.lowrank import expand_residual
    from horovod_sparse.ops.cpu.memory import accumulate_finite, copy_finite

DENORMAL = np.float32(1e-40)
LENGTHS = [0, 1, 7, 17, 64, 1000, 1001]


def bits(x):
    return np.ascontiguousarray(x).view(np.int32)


def unaligned(values):
    """``values`` copied into a larger array from element 1 on (a misaligned buffer)."""
    values = np.asarray(values, np.float32)
    base = np.zeros(values.size + 1, np.float32)
    base[1:] = values
    return base[1:]


def adversarial(n, rng):
    """Random values with zeros, negative zeros, denormals and repeated values sprinkled in."""
    x = rng.standard_normal(n).astype(np.float32)
    specials = np.array([0.0, -0.0, DENORMAL, -DENORMAL, 1.0, 1.0], np.float32)
    x[rng.integers(0, max(n, 1), size=min(n, 12))] = specials[rng.integers(0, 6, size=min(n, 12))]
    return x


# --------------------------------------------------------------- accumulate
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("misaligned", [False, True])
def test_accumulate_finite_is_numpys_add_and_check(n, misaligned):
    rng = np.random.default_rng(n)
    grad, residual = adversarial(n, rng), adversarial(n, rng)
    if misaligned:
        grad, residual = unaligned(grad), unaligned(residual)
    acc = unaligned(np.full(n, 7, np.float32)) if misaligned else np.empty(n, np.float32)
    assert accumulate_finite(grad, residual, acc) is True
    assert np.array_equal(bits(acc), bits(grad + residual))


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("where", [0, 16, 1000])
def test_accumulate_finite_sees_every_overflow(bad, where):
    grad, residual = np.ones(1001, np.float32), np.zeros(1001, np.float32)
    residual[where] = bad
    acc = np.empty_like(grad)
    assert accumulate_finite(grad, residual, acc) is False
    assert accumulate_finite(grad, residual, acc) == all_finite(grad + residual)
    big = np.full(3, 3e38, np.float32)  # finite inputs whose sum overflows
    assert accumulate_finite(big, big, np.empty(3, np.float32)) is False


# ------------------------------------------------------------------- expand
def numpy_expand(p_t, q_t, rows, cols):
    out, tmp = np.empty((rows, cols), np.float32), np.empty((rows, cols), np.float32)
    return expand(np, np.ascontiguousarray(p_t[:, :rows]), q_t, out, tmp)


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("full, cols, tail", [(0, 5, 3), (1, 1, 0), (3, 17, 0), (4, 33, 7), (2, 64, 63)])
@pytest.mark.parametrize("subtract", [True, False])
def test_expand_residual_is_two_numpy_expands(rank, full, cols, tail, subtract):
    rng = np.random.default_rng(rank * 100 + cols)
    rows = full + (1 if tail else 0)
    p_t = adversarial(rank * (rows + 1), rng).reshape(rank, rows + 1)  # one padding row beyond
    q_sum_t, q_local_t = (adversarial(rank * cols, rng).reshape(rank, cols) for _ in range(2))
    size = full * cols + tail
    acc0 = adversarial(size, rng)
    out, acc = unaligned(np.zeros(size)), unaligned(acc0)
    expand_residual(out, acc, p_t, q_sum_t, q_local_t, full, cols, tail, subtract)
    want_out = numpy_expand(p_t, q_sum_t, rows, cols).ravel()[:size]
    want_acc = acc0 - numpy_expand(p_t, q_local_t, rows, cols).ravel()[:size] if subtract else acc0
    assert np.array_equal(bits(out), bits(want_out))
    assert np.array_equal(bits(acc), bits(want_acc))


@pytest.mark.filterwarnings("ignore:invalid value")
def test_expand_residual_propagates_inf_and_nan_like_numpy():
    p_t = np.array([[np.inf, 0.0, np.nan]], np.float32)
    q_t = np.array([[0.0, 1.0]], np.float32)
    acc0 = np.ones(6, np.float32)
    out, acc = np.empty(6, np.float32), acc0.copy()
    expand_residual(out, acc, p_t, q_t, q_t, 3, 2, 0, True)
    want = numpy_expand(p_t, q_t, 3, 2).ravel()
    assert np.array_equal(bits(out), bits(want))
    assert np.array_equal(bits(acc), bits(acc0 - want))


# ------------------------------------------------------------------ spectrum
@pytest.mark.filterwarnings("ignore:overflow")
@pytest.mark.parametrize("n, chunk", [(0, 4), (1, 4), (2, 2), (7, 4), (64, 8), (1000, 64), (1001, 64),
                                      (1003, 17), (5, 1024)])
def test_energy_keys_are_numpys(n, chunk):
    rng = np.random.default_rng(n + chunk)
    spectrum = ChunkedSpectrum(n, chunk)
    values = adversarial(spectrum.size, rng)
    if values.size > 8:
        values[[0, 3, 5]] = [np.nan, np.inf, -np.nan]
        values[6:8] = [2e19, 3e19]  # the energy overflows to inf
    out = unaligned(np.zeros(spectrum.n_coefficients))
    got = spectrum.energy_keys(unaligned(values), out, np.empty(2 * max(1, spectrum.n_coefficients), np.float32))
    with cpu.numpy_only():
        want = spectrum.energy_keys(values, np.empty(spectrum.n_coefficients, np.float32),
                                    np.empty(2 * max(1, spectrum.n_coefficients), np.float32), block=5)
    assert got.dtype == np.int32 and np.array_equal(got, want)


# ---------------------------------------------------------------- pipelines
def powersgd(layout, **kw):
    return PowerSGDPipeline(layout.n if layout is not None else 700, MPI.COMM_SELF, 2, layout=layout, **kw)


def fft(n, **kw):
    return FFTSparsifier(n, MPI.COMM_SELF, theta=0.7, chunk_size=64, **kw)


LAYOUT = GradientLayout([("w", (40, 30), "float32"), ("b", (30,), "float32"), ("v", (17, 9), "float32")])


def run_steps(make, grads, wrap):
    """(outputs, state) of a pipeline made by ``make`` after a step on each of ``grads``;
    steps whose gradient overflows must raise and leave the state as it was."""
    pipeline, outputs = make(), []
    for grad in grads:
        before = pipeline.state_dict()
        if not np.isfinite(grad).all():
            with pytest.raises(NonFiniteGradientError):
                pipeline.step(wrap(grad))
            after = pipeline.state_dict()
            assert after.keys() == before.keys()
            assert all(np.array_equal(np.asarray(after[k]), np.asarray(before[k])) for k in before)
            continue
        outputs.append(np.array(pipeline.step(wrap(grad)), copy=True))
    return outputs, pipeline.state_dict()


def gradients(n, rng, steps=4):
    grads = [adversarial(n, rng) for _ in range(steps)]
    if steps > 2 and n:
        grads[2] = grads[2].copy()
        grads[2][n // 2] = np.nan  # an overflow step in the middle
    return grads


def assert_same(run_a, run_b):
    (out_a, state_a), (out_b, state_b) = run_a, run_b
    assert len(out_a) == len(out_b)
    for a, b in zip(out_a, out_b):
        assert np.array_equal(bits(a), bits(b))
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        a, b = np.asarray(state_a[key]), np.asarray(state_b[key])
        assert a.dtype == b.dtype, key
        if a.dtype.kind == "f":  # bit for bit (NaN payloads and negative zeros too)
            a, b = a.reshape(-1).view(np.uint8), b.reshape(-1).view(np.uint8)
        assert np.array_equal(a, b), key


WRAPS = {"numpy": lambda g: g, "torch": torch.from_numpy, "unaligned": unaligned}


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("layout", [LAYOUT, None])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_powersgd_steps_are_the_numpy_paths(wrap, layout, error_feedback):
    n = LAYOUT.n if layout is not None else 700
    grads = gradients(n, np.random.default_rng(3))
    make = lambda: powersgd(layout, error_feedback=error_feedback)  # noqa: E731
    fused = run_steps(make, grads, WRAPS[wrap])
    with cpu.numpy_only():
        reference = run_steps(make, grads, WRAPS[wrap])
    assert_same(fused, reference)


@pytest.mark.parametrize("n", [0, 1, 63, 1001])
def test_powersgd_small_buffers(n):
    grads = gradients(n, np.random.default_rng(n), steps=3)
    make = lambda: PowerSGDPipeline(n, MPI.COMM_SELF, 1)  # noqa: E731
    fused = run_steps(make, grads, WRAPS["numpy"])
    with cpu.numpy_only():
        assert_same(fused, run_steps(make, grads, WRAPS["numpy"]))


def test_powersgd_result_buffer_is_reused_only_when_released():
    pipeline = powersgd(LAYOUT)
    grad = np.ones(LAYOUT.n, np.float32)
    kept = pipeline.step(grad)
    first = kept.copy()
    second = pipeline.step(grad)
    assert second is not kept and np.array_equal(kept, first)  # held: a new buffer
    address = second.ctypes.data
    del second
    assert pipeline.step(grad).ctypes.data == address  # released: reused


@pytest.mark.parametrize("wrap", sorted(WRAPS))
@pytest.mark.parametrize("n", [0, 1, 63, 1001])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_fft_steps_are_the_numpy_paths(wrap, n, error_feedback):
    grads = gradients(n, np.random.default_rng(n))
    make = lambda: fft(n, error_feedback=error_feedback)  # noqa: E731
    fused = run_steps(make, grads, WRAPS[wrap])
    with cpu.numpy_only():
        reference = run_steps(make, grads, WRAPS[wrap])
    assert_same(fused, reference)


# ------------------------------------------------------------------- pieces
def test_copy_finite_is_a_copy_and_check():
    rng = np.random.default_rng(5)
    grad = unaligned(adversarial(1001, rng))
    acc = unaligned(np.full(1001, 7, np.float32))
    assert copy_finite(grad, acc) is True and np.array_equal(bits(acc), bits(grad))
    for bad in (np.inf, -np.inf, np.nan):
        grad[500] = bad
        assert copy_finite(grad, np.empty(1001, np.float32)) is False
    assert copy_finite(np.empty(0, np.float32), np.empty(0, np.float32)) is True


#: lengths of the pieces a buffer is cut into (the last piece takes the rest): a 1, an empty
#: piece (a zero-size parameter), 63 (ends mid-vector) and 1000
CUTS = [1, 0, 63, 1000]


def cut(values, dtypes):
    """``values`` (float32 numpy, n >= sum(CUTS)) cut at CUTS into numpy pieces of ``dtypes``
    (one per piece; "unaligned": float32 from a misaligned address)."""
    bounds = np.cumsum([0] + CUTS + [values.size - sum(CUTS)])
    pieces = []
    for (a, b), dtype in zip(zip(bounds[:-1], bounds[1:]), dtypes):
        part = values[a:b]
        pieces.append(unaligned(part) if dtype == "unaligned" else part.astype(dtype))
    return pieces


def torch_piece(piece, dtype):
    return torch.from_numpy(np.ascontiguousarray(piece, np.float32)).to(getattr(torch, dtype))


#: how a step's gradient comes: name -> values (float32 numpy) -> its pieces
SPLITS = {
    "float32": lambda v: cut(v, ["float32"] * 5),
    "dtypes": lambda v: cut(v, ["float64", "float16", "unaligned", "float32", "float64"]),
    "single": lambda v: [v.copy()],
    "torch32": lambda v: [torch.from_numpy(p) for p in cut(v, ["float32"] * 5)],
    "torch_dtypes": lambda v: [torch_piece(p, d) for p, d in zip(
        cut(v, ["float32"] * 5), ["float64", "float32", "bfloat16", "float16", "float32"])],
}


def fused(pieces):
    """The concatenation of the pieces cast to float32 (what the frontends fused before)."""
    return np.concatenate([np.asarray(p.float() if isinstance(p, torch.Tensor) else p, np.float32)
                           for p in pieces])


def piece_steps(n, split, rng, steps=4):
    """[(pieces, their fused float32 buffer)] per step; step 2 overflows in one piece."""
    out = []
    for step in range(steps):
        values = adversarial(n, rng)
        if step == 2:
            values[n // 2] = np.nan
        pieces = SPLITS[split](values)
        out.append((pieces, fused(pieces)))
    return out


def run_pieces(make, steps, use_pieces):
    """run_steps over ``steps``, giving each step its pieces or their fused buffer."""
    grads = [buffer for _, buffer in steps]
    given = {id(buffer): (pieces if use_pieces else buffer) for pieces, buffer in steps}
    return run_steps(make, grads, lambda buffer: given[id(buffer)])


def assert_pieces_are_the_fused_buffer(make, steps):
    with cpu.numpy_only():
        reference = run_pieces(make, steps, use_pieces=False)
        assert_same(run_pieces(make, steps, use_pieces=True), reference)
    assert_same(run_pieces(make, steps, use_pieces=True), reference)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("layout", [LAYOUT, None])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_powersgd_pieces_are_the_fused_buffer(split, layout, error_feedback):
    n = LAYOUT.n
    steps = piece_steps(n, split, np.random.default_rng(11))
    make = lambda: PowerSGDPipeline(n, MPI.COMM_SELF, 2, layout=layout, error_feedback=error_feedback)  # noqa: E731
    assert_pieces_are_the_fused_buffer(make, steps)


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("error_feedback", [True, False])
def test_fft_pieces_are_the_fused_buffer(split, error_feedback):
    n = LAYOUT.n
    steps = piece_steps(n, split, np.random.default_rng(12))
    assert_pieces_are_the_fused_buffer(lambda: fft(n, error_feedback=error_feedback), steps)


PIPELINES = {"powersgd": lambda n: PowerSGDPipeline(n, MPI.COMM_SELF, 2, layout=LAYOUT), "fft": fft}


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_pieces_of_small_buffers(kind):
    for pieces in ([], [np.empty(0, np.float32)], [np.ones(1, np.float16)], [np.ones(1, np.float64)],
                   [np.zeros(0, np.float64), np.full(1, 2, np.float32)]):
        n = sum(p.size for p in pieces)
        make = (lambda: PowerSGDPipeline(n, MPI.COMM_SELF, 1)) if kind == "powersgd" else (lambda: fft(n))  # noqa: E731
        for numpy_only in (False, True):
            with (cpu.numpy_only() if numpy_only else contextlib.nullcontext()):
                with make() as a, make() as b:
                    assert np.array_equal(np.asarray(a.step(pieces)), np.asarray(b.step(fused(pieces) if pieces
                                                                                       else np.empty(0, np.float32))))
                    assert_same(([], a.state_dict()), ([], b.state_dict()))


MIXED = ["float64", "float32", "float16", "float32", "float64"]


@pytest.mark.filterwarnings("ignore:overflow")
@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize("dtypes, where, bad", [(["float32"] * 5, 0, np.inf), (["float32"] * 5, 3, np.nan),
                                                (["float32"] * 5, 4, -np.inf), (MIXED, 2, np.inf),
                                                (MIXED, 3, np.nan), (MIXED, 4, 1e300), (MIXED, 0, -1e300)])
@pytest.mark.parametrize("numpy_only", [False, True])
def test_an_overflow_in_one_piece_skips_the_step(kind, dtypes, where, bad, numpy_only):
    n = LAYOUT.n
    rng = np.random.default_rng(13)
    with (cpu.numpy_only() if numpy_only else contextlib.nullcontext()), PIPELINES[kind](n) as pipeline:
        pipeline.step(cut(adversarial(n, rng), dtypes))
        before = pipeline.state_dict()
        pieces = cut(adversarial(n, rng), dtypes)
        pieces[where][-1] = bad  # float64's 1e300 overflows when rounded to float32
        with pytest.raises(NonFiniteGradientError):
            pipeline.step(pieces)
        after = pipeline.state_dict()
        assert_same(([], after), ([], before))
        assert after["step"] == 1
        pipeline.step(cut(adversarial(n, rng), dtypes))  # the next step runs


@pytest.mark.parametrize("kind", sorted(PIPELINES))
@pytest.mark.parametrize("pieces", [[np.zeros(LAYOUT.n - 1, np.float32)],
                                    [np.zeros(LAYOUT.n, np.float32), np.zeros(1, np.float16)],
                                    [np.zeros((LAYOUT.n, 1), np.float32)],
                                    [np.zeros(LAYOUT.n, np.int32)]])
def test_pieces_of_another_length_are_refused_naming_n(kind, pieces):
    with PIPELINES[kind](LAYOUT.n) as pipeline:
        before = pipeline.state_dict()
        with pytest.raises(ValueError, match=f"n ?= ?{LAYOUT.n}"):
            pipeline.step(pieces)
        after = pipeline.state_dict()
        after.pop("calls", None), before.pop("calls", None)  # PowerSGD counts the refused call
        assert_same(([], after), ([], before))
        assert after["step"] == 0
        pipeline.step([np.zeros(LAYOUT.n, np.float32)])  # still usable


def test_pipelines_take_pieces():
    assert PowerSGDPipeline.takes_pieces and FFTSparsifier.takes_pieces


@pytest.mark.parametrize("kind", sorted(PIPELINES))
def test_tensorflow_pieces_are_the_fused_tensor(kind):
    """Eager TensorFlow pieces (the on_device path) are fused as float32 and stepped as TensorFlow."""
    tf = pytest.importorskip("tensorflow")
    n, rng = LAYOUT.n, np.random.default_rng(14)
    with PIPELINES[kind](n) as a, PIPELINES[kind](n) as b:
        for _ in range(2):
            pieces = [tf.constant(p) for p in cut(adversarial(n, rng), MIXED)]
            got, want = a.step(pieces), b.step(tf.constant(fused([p.numpy() for p in pieces])))
            assert tf.is_tensor(got) and np.array_equal(bits(got.numpy()), bits(want.numpy()))
        assert_same(([], a.state_dict()), ([], b.state_dict()))
        with pytest.raises(ValueError, match=f"n ?= ?{n}"):
            a.step([tf.constant(np.zeros(n - 1, np.float32))])
