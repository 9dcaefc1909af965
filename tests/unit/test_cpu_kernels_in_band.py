"""The in-band compressors' fast paths against their oracles, bit for bit.

Kernel level (:mod:`horovod_sparse.ops.cpu.cast`): random-k's fused pass (acc = grad + residual,
the overflow count, the gather and the zeroing of the sent entries), the dense scatter and the
sort of the indices equal numpy's separate operations on random and adversarial inputs (zeros
of both signs, denormals, inf and NaN), lengths 0..100003, unaligned slices.

Frontend level (PyTorch): ``fp16``'s payload is numpy's ``astype(np.float16)`` (round to nearest
even, denormals, overflow to inf, -0.0, NaN) and its result that payload in float32; ``randomk``
runs several steps, an overflow among them, with the kernels on and under ``numpy_only()``, and
equals the numpy reference frontend. And the buffer reuse keeps its promises: a result is the
gradient itself or a new tensor, never a buffer of the compressor's; ``hvd.allreduce`` leaves
its input unchanged; tensors that require grad, views and non-contiguous tensors are not written.
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI  # noqa: F401  (MPI before Horovod)

import horovod.torch as hvd
import horovod_sparse.torch as hvds
from horovod_sparse.ops import cpu
from horovod_sparse.ops.base import random_indices
from horovod_sparse.reference import ReferenceCompressor

kernels = pytest.importorskip("horovod_sparse.ops.cpu.cast") if cpu.available() else None
needs_numba = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")

LENGTHS = [0, 1, 7, 63, 64, 65, 129, 1000, 100003]
KINDS = ["normal", "zeros", "denormals", "nonfinite", "huge"]
MODES = ["kernels", "numpy_only"]


@pytest.fixture(scope="module", autouse=True)
def horovod():
    hvd.init()


def bits(x):
    x = np.asarray(x)
    return x.view({2: np.int16, 4: np.int32, 8: np.int64}[x.itemsize])


def assert_bits(a, b):
    np.testing.assert_array_equal(bits(a), bits(b))


def adversarial(n, rng, kind, dtype=np.float32):
    """Vectors that stress the arithmetic: zeros of both signs, denormals, inf/NaN, overflowing sums."""
    x = rng.standard_normal(n).astype(dtype)
    if kind == "zeros":
        x = np.where(rng.random(n) < 0.5, dtype(-0.0), dtype(0.0)).astype(dtype)
    elif kind == "denormals":
        x = (rng.standard_normal(n) * np.finfo(dtype).smallest_subnormal * 8).astype(dtype)
    elif kind == "nonfinite" and n:
        x[rng.integers(0, n, max(1, n // 50))] = rng.choice(np.array([np.inf, -np.inf, np.nan], dtype))
    elif kind == "huge":  # sums past the range: inf from finite terms
        x = (np.sign(rng.standard_normal(n)) * np.finfo(dtype).max * 0.75).astype(dtype)
    return x


def draw(n, rng, share=0.1):
    """Sorted distinct indices into [0, n), the first and last among them where n allows."""
    if n == 0:
        return np.zeros(0, np.int64)
    k = max(1, int(n * share))
    idx = set(rng.choice(n, size=k, replace=False).tolist()) | {0, n - 1}
    return np.array(sorted(idx), np.int64)


def mode_context(mode):
    return cpu.numpy_only() if mode == "numpy_only" else _nothing()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# -- kernels ------------------------------------------------------------------------------
@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", LENGTHS)
def test_accumulate_pick_equals_numpy(n, kind, dtype):
    rng = np.random.default_rng(n + len(kind))
    grad, residual = adversarial(n + 1, rng, kind, dtype)[1:], adversarial(n, rng, "normal", dtype)  # grad unaligned
    idx = draw(n, rng)
    acc, values = np.full(n, 7, dtype), np.full(idx.size, 7, dtype)
    bad = kernels.accumulate_pick(grad, residual, acc, idx, values)
    with np.errstate(over="ignore", invalid="ignore"):
        want = grad + residual
    assert bad == np.count_nonzero(~np.isfinite(want))
    want_values = want[idx].copy()
    want[idx] = 0
    assert_bits(values, want_values)
    assert_bits(acc, want)


@needs_numba
@pytest.mark.parametrize("n", LENGTHS)
def test_scatter_dense_equals_numpy(n):
    rng = np.random.default_rng(n)
    idx = draw(n, rng, share=0.3)
    values = adversarial(idx.size, rng, "nonfinite")
    out = np.full(n + 3, 5, np.float32)[3:]  # unaligned, dirty
    kernels.scatter_dense(out, idx, values)
    want = np.zeros(n, np.float32)
    want[idx] = values
    assert_bits(out, want)
    # indices into a fused buffer, the gradient at offset 1000 in it
    kernels.scatter_dense(out, idx + 1000, values, 1000)
    assert_bits(out, want)


@needs_numba
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int32, np.int64])
@pytest.mark.parametrize("n", LENGTHS)
def test_indexed_loads_and_stores_equal_numpy(n, dtype):
    """Every sparsifier's gather of its selected entries and the zeroing of its residual there
    (:func:`~horovod_sparse.ops.indices.take`, :func:`~horovod_sparse.ops.kernels.zero_at`): the
    compiled loops equal numpy's indexing on sorted, unsorted and repeated indices, int32 and
    int64, unaligned numpy buffers and CPU tensors, and under ``numpy_only()``."""
    from horovod_sparse.ops.indices import take
    from horovod_sparse.ops.kernels import zero_at
    rng = np.random.default_rng(n + 17)
    if np.dtype(dtype).kind == "f":
        x = adversarial(n + 1, rng, "nonfinite", dtype)[1:]             # unaligned, inf and NaN
    else:
        x = rng.integers(-2**31, 2**31, n + 1).astype(dtype)[1:]
    sorted_idx = draw(n, rng)
    orders = [sorted_idx, rng.permutation(sorted_idx), np.repeat(sorted_idx, 2)]
    for idx in orders:
        for index_dtype in (np.int64, np.int32):
            i = idx.astype(index_dtype)
            want_taken = x[i]
            want_zeroed = x.copy()
            want_zeroed[i] = 0
            for mode in MODES:
                with mode_context(mode):
                    assert_bits(take(x, i), want_taken)
                    assert_bits(take(torch.from_numpy(x), torch.from_numpy(i)).numpy(), want_taken)
                    y = x.copy()
                    assert zero_at(y, i) is y
                    assert_bits(y, want_zeroed)
                    t = torch.from_numpy(x.copy())
                    assert zero_at(t, torch.from_numpy(i.astype(np.int64))) is t
                    assert_bits(t.numpy(), want_zeroed)


@needs_numba
def test_indexed_loads_and_stores_refuse_an_index_out_of_range_and_write_nothing():
    from horovod_sparse.ops.indices import take
    from horovod_sparse.ops.kernels import zero_at
    x = np.arange(1, 11, dtype=np.float32)
    for bad in ([3, 10], [-1, 2], [11]):
        i = np.array(bad, np.int64)
        with pytest.raises(IndexError):
            take(x, i)
        y = x.copy()
        with pytest.raises(IndexError):
            zero_at(y, i)
        assert_bits(y, x)  # not half cleared


@needs_numba
@pytest.mark.parametrize("n,k", [(1, 1), (2, 1), (7, 3), (65, 64), (1000, 10), (1000, 999), (10**6, 10**4),
                                 (2**40, 1000)])
def test_sort_distinct_equals_numpy(n, k):
    rng = np.random.default_rng(k)
    raw = rng.choice(min(n, 10**7), size=k, replace=False).astype(np.int64) * (n // min(n, 10**7))
    np.testing.assert_array_equal(kernels.sort_distinct(raw, n), np.sort(raw))


@pytest.mark.parametrize("n,k", [(0, 0), (1, 1), (10, 3), (1000, 10), (25_000_000, 250_000)])
def test_random_indices_are_the_same_either_way(n, k):
    """The draw is numpy's; only the sort changes: the same sorted indices on every path."""
    with cpu.numpy_only():
        want = random_indices(5, 2, 11, n, k)
    got = random_indices(5, 2, 11, n, k)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64 and np.all(np.diff(got) > 0)


# -- fp16 through the PyTorch frontend ----------------------------------------------------
def fp16_adversarial():
    """float32 values at float16's edges: ties (round to even), denormals, the largest finite
    value and the first to overflow, signed zeros, inf and NaN."""
    half_ulp_at_1 = 2.0 ** -11
    values = [0.0, -0.0, 1.0, 1.0 + half_ulp_at_1, 1.0 + 3 * half_ulp_at_1, -(1.0 + half_ulp_at_1),
              2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -25 * 1.0000001, 6.1e-5, 6.0e-5, 1e-8, -1e-8,
              65504.0, 65519.996, 65520.0, -65520.0, 1e6, np.inf, -np.inf, np.nan, -np.nan,
              float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).smallest_subnormal)]
    return np.array(values, np.float32)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
def test_fp16_equals_numpy_astype(n, mode):
    rng = np.random.default_rng(n)
    x = np.concatenate([fp16_adversarial(), (rng.standard_normal(n) * 1000).astype(np.float32)])[:max(n, 1)]
    x = x[:n] if n else x[:0]
    compressor = hvds.Compression.fp16()
    with mode_context(mode):
        for step in range(2):  # the second reuses the wire buffer
            grad = torch.from_numpy(x.copy())
            payload, ctx = compressor.compress(grad)
            assert payload.dtype == torch.float16
            assert_bits(payload.numpy(), x.astype(np.float16))
            result = compressor.decompress(payload, ctx)
            assert_bits(result.numpy(), x.astype(np.float16).astype(np.float32))


def test_fp16_reuses_its_wire_buffer_and_returns_the_gradient():
    compressor = hvds.Compression.fp16()
    grads = [torch.randn(300, 7) for _ in range(2)]
    wires = []
    for grad in grads:
        want = grad.numpy().astype(np.float16).astype(np.float32)
        payload, ctx = compressor.compress(grad)
        wires.append(payload.data_ptr())
        result = compressor.decompress(payload, ctx)
        assert result is grad and result.shape == (300, 7)  # in place, as Horovod's optimizer sets it
        assert_bits(result.numpy(), want)
    assert wires[0] == wires[1]  # one buffer per gradient, reused


@pytest.mark.parametrize("spec", ["fp16", "randomk:density=0.1"])
def test_hvd_allreduce_leaves_its_input_and_results_alone(spec):
    """``hvd.allreduce`` promises an unchanged input: the result is a new tensor, which the next
    call does not overwrite."""
    compressor = hvds.Compression.from_spec(spec)
    inputs = [torch.randn(1000) for _ in range(3)]
    kept = [t.clone() for t in inputs]
    results = [hvd.allreduce(t, name="g", op=hvd.Sum, compression=compressor) for t in inputs]
    firsts = [r.clone() for r in results]
    for t, k in zip(inputs, kept):
        assert torch.equal(t, k)
    for r, t, f in zip(results, inputs, firsts):
        assert r.data_ptr() != t.data_ptr() and torch.equal(r, f)
    if spec == "fp16":
        assert_bits(results[0].numpy(), kept[0].numpy().astype(np.float16).astype(np.float32))
    grouped = hvd.grouped_allreduce([t for t in inputs], op=hvd.Sum, compression=hvds.Compression.from_spec(spec))
    for t, k, g in zip(inputs, kept, grouped):
        assert torch.equal(t, k) and g.data_ptr() != t.data_ptr()


def test_fp16_under_autograd_gets_new_tensors():
    compressor = hvds.Compression.fp16()
    x = torch.randn(100, requires_grad=True)
    y = hvd.allreduce(x, op=hvd.Sum, compression=compressor)
    y.sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.ones(100))
    payload, ctx = compressor.compress(x)  # a bare call on a tensor autograd tracks
    assert payload.requires_grad
    assert compressor.decompress(payload.detach(), ctx) is not x


@pytest.mark.parametrize("make", [lambda: torch.randn(40, 30).t(), lambda: torch.randn(100)[10:70],
                                  lambda: torch.randn(8, 9).expand(3, 8, 9)],
                         ids=["non_contiguous", "view", "expanded"])
@pytest.mark.parametrize("spec", ["fp16", "randomk:density=0.2"])
def test_tensors_not_written_in_place(make, spec):
    """A non-contiguous tensor, a view or an expanded one gets a new result of the same values."""
    compressor, oracle = hvds.Compression.from_spec(spec), hvds.Compression.from_spec(spec)
    grad = make()
    kept = grad.clone()
    payload, ctx = compressor.compress(grad)
    result = compressor.decompress(payload.clone(), ctx)
    assert torch.equal(grad, kept)
    want = oracle.decompress(*oracle.compress(kept.contiguous().clone()))
    assert_bits(result.contiguous().numpy(), want.numpy())


# -- randomk through the PyTorch frontend -------------------------------------------------
SHAPES = [(300, 70), (1,), (65,), (7, 9)]


def randomk_run(mode, spec="randomk:density=0.05,seed=3", steps=5, bad_step=2):
    """Results, payloads and saved state of a few steps; on ``bad_step`` one gradient holds inf."""
    rng = np.random.default_rng(0)
    compressor = hvds.Compression.from_spec(spec)
    out = []
    with mode_context(mode):
        for step in range(steps):
            grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            if step == bad_step:
                grads[0].reshape(-1)[5] = np.inf
            compressed = [compressor.compress(torch.from_numpy(g.copy())) for g in grads]
            payloads = [p.numpy().copy() for p, _ in compressed]
            results = [compressor.decompress(p, ctx).numpy().copy() for p, ctx in compressed]
            out.append((payloads, results, compressor.state_dict()))
    return out


def reference_run(spec="randomk:density=0.05,seed=3", steps=5, bad_step=2):
    rng = np.random.default_rng(0)
    compressor = ReferenceCompressor.from_spec(spec)
    out = []
    for step in range(steps):
        grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        if step == bad_step:
            grads[0].reshape(-1)[5] = np.inf
        compressed = [compressor.compress(g.copy(), key) for key, g in enumerate(grads)]
        payloads = [np.asarray(p).copy() for p, _ in compressed]
        results = [np.asarray(compressor.decompress(p, ctx)).copy() for p, ctx in compressed]
        out.append((payloads, results, compressor.state_dict()))
    return out


def assert_same_runs(a, b):
    for (pa, ra, sa), (pb, rb, sb) in zip(a, b):
        for x, y in zip(pa + ra, pb + rb):
            assert_bits(x, y)
        assert sa.keys() == sb.keys()
        for key in sa:
            assert sa[key]["step"] == sb[key]["step"]
            assert_bits(sa[key]["residual"], sb[key]["residual"])


@pytest.mark.parametrize("error_feedback", [True, False])
def test_randomk_kernels_equal_numpy_only_and_the_reference(error_feedback):
    spec = f"randomk:density=0.05,seed=3,error_feedback={error_feedback}"
    fast, slow, ref = randomk_run("kernels", spec), randomk_run("numpy_only", spec), reference_run(spec)
    assert_same_runs(fast, slow)
    assert_same_runs(fast, ref)
    assert np.isnan(fast[2][1][0]).all()  # the overflowed gradient: NaN on every rank


def test_randomk_overflow_changes_no_state():
    run = randomk_run("kernels")
    before, after = run[1][2], run[2][2]  # the step that overflowed left every slot as it was
    for key in before:
        assert before[key]["step"] == after[key]["step"]
        assert_bits(before[key]["residual"], after[key]["residual"])


def test_randomk_writes_its_result_into_the_gradient():
    compressor = hvds.Compression.randomk(density=0.1)
    grad = torch.randn(50, 20)
    payload, ctx = compressor.compress(grad)
    result = compressor.decompress(payload, ctx)
    assert result.data_ptr() == grad.data_ptr()
    assert torch.count_nonzero(grad) <= payload.numel()



@pytest.mark.parametrize("spec", ["fp16", "randomk:density=0.1"])
def test_compress_leaves_the_gradient_until_decompress(spec):
    """A caller may still read the gradient between compress and decompress (only decompress writes it)."""
    compressor = hvds.Compression.from_spec(spec)
    for _ in range(2):
        grad = torch.randn(64, 33)
        kept = grad.clone()
        payload, ctx = compressor.compress(grad)
        assert torch.equal(grad, kept)
        compressor.decompress(payload, ctx)
