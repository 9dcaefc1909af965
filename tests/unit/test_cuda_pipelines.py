"""Every out-of-band pipeline on torch tensors of a device, against the numpy pipeline (the oracle).

Why: the frontends hand a pipeline the gradients where they live, and on a GPU the step runs
torch's own kernels on the device (``horovod_sparse/ops/``), a code path the CPU suite reaches
only partly (on the CPU, torch tensors run numpy's kernels on zero-copy views). These tests
are what a machine with CUDA runs to check that path. The ``cpu`` case runs the same bodies
under the device path (``HOROVOD_SPARSE_KERNELS=torch``: ``cpu.device_path()``), where CPU
tensors run exactly the torch ops a CUDA tensor runs, so every machine checks that code
against the oracle; the ``cuda`` case is skipped, and counted as skipped, where
``torch.cuda.is_available()`` is False.

Each case makes two pipelines of one compressor with ``horovod_sparse.create(spec)`` and
``make_pipeline(n, MPI.COMM_SELF, layout=LAYOUT)``: the oracle, fed numpy arrays, and the one
under test, fed the same gradients as torch tensors on the device. What must agree:

- bit for bit (sparsifiers, quantizers, the dense sum: their device code is documented to
  give numpy's bits: integer magnitude keys, hash-based random numbers, fixed-order sums,
  element-wise float32 arithmetic): every step's result, what the step selected and sent,
  and every field of ``state_dict()`` after every step, with no resynchronisation;
- within the tolerances of the CPU tests of torch's own kernels (``tests/parallel/quantize/
  test_powersgd.py`` and ``test_fft.py``, documented in docs/powersgd.md and docs/fft.md),
  each step from the oracle's state: PowerSGD within 1e-5 x max|result| per matrix (another
  BLAS rounds P = M Q and Q = M^T P differently), its dense part bitwise; FFT with the same
  selection up to near-ties and ||result - oracle||_2 <= sqrt(2) (2 eps_code + 2^-20) ||acc||_2
  (float32 transforms round differently); the residuals within the same bounds, conservation
  (kept + residual == acc to one rounding) on the device's own numbers, the exchange's carried
  thresholds (a coefficient's magnitude) within the result's bound, the other fields exact.

And the overflow contract (``horovod_sparse/nonfinite.py``): a gradient holding inf or NaN makes
``step`` (``step_sparse`` for the sparsifiers) raise ``NonFiniteGradientError``, leaves every
field of ``state_dict()`` as it was before the call, and the next finite step equals the oracle
of a pipeline that never saw the bad step.
"""
import contextlib
import math

import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse import registry
from horovod_sparse.exchange import NonFiniteGradientError
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu

torch = pytest.importorskip("torch")

CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[
               pytest.mark.cuda,
               pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")])]

#: carried by Horovod's own allreduce: no pipeline of their own (docs/architecture.md)
IN_BAND = ("none", "fp16", "randomk")
#: a small model's gradients, fused: two weight matrices (PowerSGD compresses them) and two biases
LAYOUT = GradientLayout([("fc1.weight", (40, 32), "float32"), ("fc1.bias", (40,), "float32"),
                         ("fc2.weight", (10, 40), "float32"), ("fc2.bias", (10,), "float32")])
STEPS = 5
EPS32 = float(np.finfo(np.float32).eps)
#: one spec per out-of-band compressor (parameters sized for LAYOUT.n = 1730 elements), and a
#: few variants whose exchange or memory runs other device code
SPECS = [
    "topk:density=0.05", "topk:density=0.05,exchange=dsa", "oktopk:density=0.05,tau_prime=2",
    "gtopk:density=0.05", "gaussiank:density=0.05", "threshold:value=1.5",
    "dgc:density=0.05,sample_fraction=0.1",
    "dense", "dense:method=alltoall",
    "bf16:error_feedback=true", "qsgd:bucket_size=128", "int4:bits=3,bucket_size=64", "qsgd:bucket_size=128,error_feedback=true,method=allgather",
    "terngrad:error_feedback=true", "signsgd", "signum:momentum=0.5", "efsignsgd", "onebit",
    "onebit:bucket_size=64", "powersgd:rank=2", "powersgd:rank=1,warm_start=false",
    "fft:chunk_size=256,bits=16,theta=0.8", "fft:chunk_size=200,bits=16,theta=0.8,exchange=oktopk",
]
#: families whose device kernels round differently from numpy's (matmuls, float32 FFTs)
TOLERANT = ("powersgd", "fft")


def name_of(spec):
    return registry.parse_spec(spec)[0]


def gradient(step):
    """This step's gradient: normal values spread over six binades (so top-k, thresholds and
    the codes' buckets all have work), reproducible per step."""
    rng = np.random.default_rng(1000 + step)
    return (rng.standard_normal(LAYOUT.n) * 2.0 ** rng.uniform(-3, 3, LAYOUT.n)).astype(np.float32)


def as_numpy(x):
    """A host copy (results of the dense sum are its reused buffer, valid until the next step)."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy().copy()
    return np.array(x, copy=True)


def pipeline(spec):
    return horovod_sparse.create(spec).make_pipeline(LAYOUT.n, MPI.COMM_SELF, layout=LAYOUT)


def sparse_result(pipe):
    return hasattr(pipe, "step_sparse")


def run(pipe, grad, tag=LAYOUT.tag):
    """One step: ``step_sparse`` for the sparsifiers (what the PyTorch frontend calls), densified
    here by the test; ``step`` for the others. Returns the host copy of the sum and the raw
    result (for its device)."""
    if sparse_result(pipe):
        indices, values = pipe.step_sparse(grad, tag=tag)
        dense = np.zeros(LAYOUT.n, np.float32)
        dense[as_numpy(indices)] = as_numpy(values)
        return dense, values
    out = pipe.step(grad, tag=tag)
    return as_numpy(out), out


def same_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_same_state(got, want, what):
    """Every field of two ``state_dict()``s equal, arrays bit for bit."""
    assert set(got) == set(want), f"{what}: fields {sorted(got)} != {sorted(want)}"
    for key, value in want.items():
        if isinstance(value, np.ndarray) or isinstance(got[key], np.ndarray):
            assert isinstance(got[key], np.ndarray), f"{what}: {key} is {type(got[key]).__name__}, not numpy"
            assert same_bits(got[key], value), f"{what}: {key} differs"
        else:
            assert got[key] == value, f"{what}: {key} = {got[key]!r}, expected {value!r}"


def live_vectors(pipe):
    """The state vectors the pipeline keeps between steps (residual, DGC's velocity, Signum's
    momentum), where they are in use."""
    memory = getattr(pipe, "memory", None)
    if memory is not None and not getattr(memory, "enabled", True):
        return {}
    return {name: getattr(pipe, name) for name in ("residual", "velocity", "momentum_buffer")
            if getattr(pipe, name, None) is not None}


def assert_on(x, device, what):
    assert isinstance(x, torch.Tensor), f"{what} is {type(x).__name__}, not a torch tensor"
    assert x.device.type == device, f"{what} is on {x.device}, not {device}"


def check_step(name, oracle, on_device, expected, got, raw, acc, device, what):
    """The device step against the oracle's: bit for bit, or within the family's tolerance
    (``acc``: the vector both compressed, grad + the state both started from). Returns False
    when an FFT step could not be compared (a near-tie swapped a coefficient)."""
    assert_on(raw, device, f"{what}: the result")
    assert raw.dtype == torch.float32, f"{what}: result dtype {raw.dtype}"
    for field, vector in live_vectors(on_device).items():
        assert_on(vector, device, f"{what}: {field}")
    if name == "powersgd":
        return check_powersgd(oracle, on_device, expected, got, acc, what)
    if name == "fft":
        return check_fft(oracle, on_device, expected, got, acc, what)
    assert same_bits(got, expected), f"{what}: result differs from numpy's in {np.count_nonzero(got != expected)} places"
    if sparse_result(oracle):
        mine, theirs = on_device.last, oracle.last
        for field in ("local_indices", "sent_values", "selected", "cleared_indices", "kept_values"):
            assert same_bits(as_numpy(getattr(mine, field)), as_numpy(getattr(theirs, field))), f"{what}: {field}"
    assert on_device.last.traffic == oracle.last.traffic, f"{what}: traffic"
    assert_same_state(on_device.state_dict(), oracle.state_dict(), what)
    return True


def check_powersgd(oracle, on_device, expected, got, acc, what):
    """docs/powersgd.md: within 1e-5 x max|result| per matrix, the dense part bitwise; the
    residual conserves acc to one rounding; the warm-start Q's within the same bound."""
    dense = np.ones(LAYOUT.n, bool)
    kept = as_numpy(on_device.last.kept).astype(np.float64)
    residual = as_numpy(on_device.residual) if on_device.residual is not None else None
    for block in oracle.plan.matrices:
        span = slice(block.offset, block.offset + block.size)
        dense[span] = False
        scale = np.abs(expected[span]).max()
        error = np.abs(got[span] - expected[span]).max()
        assert error <= 1e-5 * scale, f"{what}: matrix {block.key} off by {error:.3g} (max |result| {scale:.3g})"
    assert same_bits(got[dense], expected[dense]), f"{what}: the dense part differs"
    state, want = on_device.state_dict(), oracle.state_dict()
    assert set(state) == set(want), what
    for key, value in want.items():
        if key.startswith("q_"):
            error = np.abs(state[key] - value).max()
            assert error <= 1e-5 * np.abs(value).max(), f"{what}: {key} off by {error:.3g}"
        elif key == "residual" and value.size:
            a64 = acc.astype(np.float64)
            # conservation on the device's numbers: residual = float32(acc - kept), correctly rounded
            assert np.all(np.abs(kept + residual - a64) <= 0.5 * EPS32 * np.abs(a64 - kept)), f"{what}: conservation"
            assert same_bits(residual[dense], value[dense]), f"{what}: residual of the dense part"
            bound = 1e-5 * np.abs(expected).max() + EPS32 * (np.abs(acc) + np.abs(expected))
            assert np.all(np.abs(residual - value) <= bound), f"{what}: residual"
        else:
            assert np.array_equal(np.asarray(state[key]), np.asarray(value)), f"{what}: {key}"
    return True


def chunked_energies(acc, chunk_size):
    """float64 energy of every complex coefficient of acc's chunked orthonormal spectrum
    (twice |c|^2 except DC and an even chunk's Nyquist), in the pipeline's coefficient order."""
    energies = []
    for start in range(0, acc.size, chunk_size):
        part = acc[start:start + chunk_size].astype(np.float64)
        c = np.fft.rfft(part, norm="ortho")
        weights = np.full(c.size, 2.0)
        weights[0] = 1.0
        if part.size % 2 == 0:
            weights[-1] = 1.0
        energies.append(weights * np.abs(c) ** 2)
    return np.concatenate(energies)


def check_fft(oracle, on_device, expected, got, acc, what):
    """docs/fft.md: the same selection up to near-ties at the threshold (energy within 1e-4 of
    the k-th); then ||result - numpy's||_2 <= sqrt(2) (2 eps_code + 2^-20) ||acc||_2 (P = 1),
    the residual within that plus two roundings, conservation on the device's own numbers."""
    energies = chunked_energies(acc, oracle.chunk_size)
    mine = as_numpy(on_device.last.indices)[0::2] // 2
    theirs = oracle.last.indices[0::2] // 2
    kth = energies[theirs].min()
    swapped = np.setxor1d(mine, theirs)
    assert np.all(np.abs(energies[swapped] - kth) <= 1e-4 * kth), f"{what}: selection differs beyond near-ties"
    kept = as_numpy(on_device.last.kept)
    residual = as_numpy(on_device.residual)
    assert np.all(np.abs(kept + residual - acc) <= 2.0 ** -23 * (np.abs(acc) + np.abs(kept))), f"{what}: conservation"
    norm = np.linalg.norm(acc.astype(np.float64))
    bound = math.sqrt(2) * (2 * oracle.codec.relative_error + 2.0 ** -20) * norm
    state, want = on_device.state_dict(), oracle.state_dict()
    assert set(state) == set(want), what
    for key, value in want.items():
        if key.endswith("threshold"):  # a coefficient's magnitude: as close as the coefficients
            # (measured on an H100: the DC term's imaginary part, 0 in numpy, 6.7e-8 from cuFFT)
            assert abs(float(state[key]) - float(value)) <= bound, f"{what}: {key}"
        elif key != "residual":
            assert np.array_equal(np.asarray(state[key]), np.asarray(value)), f"{what}: {key}"
    if swapped.size:
        return False
    error = np.linalg.norm(got.astype(np.float64) - expected)
    assert error <= bound, f"{what}: result off by {error:.3g} (bound {bound:.3g})"
    res_bound = bound + 2.0 ** -23 * (norm + np.linalg.norm(expected.astype(np.float64)))
    res_error = np.linalg.norm(state["residual"].astype(np.float64) - want["residual"])
    assert res_error <= res_bound, f"{what}: residual off by {res_error:.3g} (bound {res_bound:.3g})"
    return True


def oracle_acc(oracle, grad):
    """What the step about to run compresses: grad + the oracle's residual (float32, as the
    memory adds), for the tolerance checks."""
    state = oracle.state_dict()
    residual = state.get("residual")
    if residual is None or residual.size == 0:
        return grad.copy()
    return (grad + residual).astype(np.float32)


def to_device(grad, device):
    return torch.from_numpy(grad.copy()).to(device)


def device_code(device):
    """Where the device's code runs: on the CPU only under the device path (the numpy oracle's
    arrays still run numpy's code inside it)."""
    return cpu.device_path() if device == "cpu" else contextlib.nullcontext()


# --------------------------------------------------------------------------- the cases
def test_every_out_of_band_compressor_has_a_case():
    """The list above covers registry.available() minus the in-band three, so a compressor added
    later fails here until it has a case (and the in-band ones really have no pipeline)."""
    out_of_band = [n for n in registry.available() if n not in IN_BAND]
    for n in registry.available():
        assert bool(getattr(registry.get(n), "out_of_band", False)) == (n not in IN_BAND), n
    assert sorted({name_of(spec) for spec in SPECS}) == out_of_band


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_device_steps_equal_the_numpy_steps(spec, device):
    name = name_of(spec)
    tolerant = name in TOLERANT
    compared = 0
    with device_code(device), pipeline(spec) as oracle, pipeline(spec) as on_device:
        for step in range(STEPS):
            if tolerant:  # from the oracle's state: one step's difference, as documented
                on_device.load_state_dict(oracle.state_dict())
            grad = gradient(step)
            acc = oracle_acc(oracle, grad)
            expected, _ = run(oracle, grad)
            got, raw = run(on_device, to_device(grad, device))
            compared += check_step(name, oracle, on_device, expected, got, raw, acc, device,
                                   f"{spec} on {device}, step {step}")
        assert np.any(expected != 0), "the oracle summed nothing: the comparison would be vacuous"
    assert compared >= STEPS - 1, f"only {compared} of {STEPS} steps compared (near-ties are rare)"


#: step -> the value put into that step's gradient (at three places); the other steps are finite
BAD = {0: -np.inf, 2: np.nan, 3: np.inf}
OVERFLOW_STEPS = 6


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS)
def test_overflow_raises_keeps_the_state_and_the_next_step_is_the_oracles(spec, device):
    """A loss scaler's overflow (horovod_sparse/nonfinite.py): the bad steps raise, change no
    field of the state, and the finite steps equal those of an oracle that never saw them.
    Bad steps come first (nothing bound to the device yet) and back to back."""
    name = name_of(spec)
    tolerant = name in TOLERANT
    previous_bad = False
    finite_after_bad = 0
    with device_code(device), pipeline(spec) as oracle, pipeline(spec) as on_device:
        for step in range(OVERFLOW_STEPS):
            what = f"{spec} on {device}, step {step}"
            if tolerant and not previous_bad:
                # from the oracle's state; not after a bad step, which must have changed nothing
                on_device.load_state_dict(oracle.state_dict())
            grad = gradient(step)
            if step in BAD:
                grad[[0, 777, LAYOUT.n - 1]] = BAD[step]
                before = on_device.state_dict()
                with pytest.raises(NonFiniteGradientError):
                    run(on_device, to_device(grad, device))
                assert_same_state(on_device.state_dict(), before, f"{what} (after the overflow)")
                previous_bad = True
                continue
            acc = oracle_acc(oracle, grad)
            expected, _ = run(oracle, grad)
            got, raw = run(on_device, to_device(grad, device))
            compared = check_step(name, oracle, on_device, expected, got, raw, acc, device, what)
            finite_after_bad += bool(previous_bad and compared)
            previous_bad = False
    assert finite_after_bad >= 1, "no finite step after a bad one was compared"
