"""The sparsifiers' fused first pass (horovod_sparse.ops.cpu.sparsify) against numpy, bit for bit.

Kernel level: acc, the candidates (indices, keys, count past the buffer's capacity) and the
overflow count equal numpy's separate passes on random and adversarial inputs. Pipeline level:
every sparsifier, several steps, gives the same outputs, state and step records with the
kernels on and with ``numpy_only()``, on numpy arrays and CPU tensors, whole or in pieces; an
overflow changes nothing either way.
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.ops import cpu
from horovod_sparse.ops.magnitude import magnitude_keys
from kernel_inputs import adversarial, unaligned

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")
fused = pytest.importorskip("horovod_sparse.ops.cpu.sparsify")

LENGTHS = [0, 1, 7, 63, 64, 65, 129, 1000, 100003]


def bits(x):
    return np.asarray(x, np.float32).view(np.int32)


def numpy_candidates(acc, floor):
    keys = magnitude_keys(np.ascontiguousarray(acc))
    picked = np.flatnonzero(keys >= floor)
    return picked, keys[picked], int(np.count_nonzero(~np.isfinite(acc)))


@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "denormals", "nonfinite"])
def test_accumulate_scan_equals_numpy(n, kind):
    rng = np.random.default_rng(n)
    grad, residual = unaligned(adversarial(n, rng, kind)), adversarial(n, rng, kind)
    acc = unaligned(np.zeros(n, np.float32))
    expected = grad + residual
    floor = int(np.median(magnitude_keys(expected))) if n else 0
    index, key = np.empty(n + 1, np.int64), np.empty(n + 1, np.int32)
    count, nonfinite = fused.accumulate_scan(grad, residual, acc, np.int32(floor), index, key, 0, 0)
    want_index, want_key, want_nonfinite = numpy_candidates(expected, floor)
    assert np.array_equal(bits(acc), bits(expected))
    assert count == want_index.size and nonfinite == want_nonfinite
    assert np.array_equal(index[:count], want_index) and np.array_equal(key[:count], want_key)


@pytest.mark.parametrize("n", [1, 65, 1000, 100003])
def test_momentum_scan_equals_numpy_two_passes(n):
    rng = np.random.default_rng(n)
    grad, velocity, residual = (adversarial(n, rng, "normal") for _ in range(3))
    grad[::97] = np.float32(-0.0)
    momentum = np.float32(0.9)
    u_out, acc = np.empty(n, np.float32), unaligned(np.empty(n, np.float32))
    floor = int(magnitude_keys(np.float32([1.0]))[0])
    index, key = np.empty(n, np.int64), np.empty(n, np.int32)
    count, nonfinite = fused.momentum_scan(grad, velocity, residual, momentum, u_out, acc, np.int32(floor),
                                           index, key, 0, 0)
    u = np.multiply(velocity, momentum)  # the numpy path: two passes, the same float32 operations
    u = np.add(u, grad)
    assert np.array_equal(bits(u_out), bits(u)) and np.array_equal(bits(acc), bits(residual + u))
    want_index, want_key, _ = numpy_candidates(residual + u, floor)
    assert count == want_index.size and nonfinite == 0 and np.array_equal(index[:count], want_index)


def test_count_goes_on_past_the_capacity_and_pieces_continue_it():
    rng = np.random.default_rng(3)
    acc = rng.standard_normal(10_000).astype(np.float32)
    floor = int(magnitude_keys(np.float32([0.5]))[0])
    want, want_keys, _ = numpy_candidates(acc, floor)
    index, key = np.empty(100, np.int64), np.empty(100, np.int32)
    count, _ = fused.scan(acc[:4000], np.int32(floor), index, key, 0, 0)     # piece 1 at offset 0
    count, _ = fused.scan(acc[4000:], np.int32(floor), index, key, count, 4000)  # piece 2 at 4000
    assert count == want.size > 100
    assert np.array_equal(index, want[:100]) and np.array_equal(key, want_keys[:100])


def test_no_floor_collects_only_the_largest_nans_and_counts_overflows():
    acc = np.array([1.0, np.inf, -np.inf, np.nan, 3e38, -0.0], np.float32)
    index, key = np.empty(6, np.int64), np.empty(6, np.int32)
    count, nonfinite = fused.scan(acc, np.int32(fused.NO_FLOOR), index, key, 0, 0)
    assert nonfinite == 3 and count == 0  # numpy's NaN is 0x7FC00000, below the all-ones NaN
    all_ones_nan = np.array([-1], np.int32).view(np.float32)  # key 0x7FFFFFFF, the largest
    count, _ = fused.scan(all_ones_nan, np.int32(fused.NO_FLOOR), index, key, 0, 0)
    assert count == 1 and key[0] == fused.NO_FLOOR


# ------------------------------------------------------------------------------ pipelines
SPECS = ["topk", "topk:density=0.05", "topk:exchange=oktopk", "topk:exchange=gtopk", "oktopk",
         "oktopk:warmup_steps=2", "gaussiank", "threshold:value=1.5", "dgc", "topk:density=1.0"]


def run(spec, grads, as_torch=False, pieces=None, numpy_only=False):
    """Every step's (indices, values), the records and the final state of one sparsifier."""
    compressor = horovod_sparse.create(spec)
    out = []
    with compressor.make_pipeline(grads[0].size, MPI.COMM_SELF) as sparsifier:
        with (cpu.numpy_only() if numpy_only else _nothing()):
            for grad in grads:
                g = torch.from_numpy(grad.copy()) if as_torch else grad.copy()
                if pieces:
                    g = [g[a:b] for a, b in zip([0] + pieces, pieces + [grad.size])]
                indices, values = sparsifier.step_sparse(g)
                info = sparsifier.last
                out.append((np.asarray(indices).copy(), bits(np.asarray(values)).copy(), info.method,
                            np.asarray(info.cleared_indices).copy()))
        state = sparsifier.state_dict()
        assert (sparsifier._candidate_scratch is not None) == (not numpy_only)  # the path under test ran
    return out, state


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def assert_same(a, b):
    (steps_a, state_a), (steps_b, state_b) = a, b
    for x, y in zip(steps_a, steps_b):
        assert np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) and x[2] == y[2]
        assert np.array_equal(x[3], y[3])
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        va, vb = np.asarray(state_a[key]), np.asarray(state_b[key])
        same = np.array_equal(va.view(np.int32), vb.view(np.int32)) if va.dtype == np.float32 else \
            np.array_equal(va, vb)
        assert same, key


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("as_torch", [False, True])
def test_every_sparsifier_steps_the_same_with_kernels_and_numpy(spec, as_torch):
    rng = np.random.default_rng(7)
    n = 5003
    grads = [(rng.standard_normal(n) * (1 + step)).astype(np.float32) for step in range(6)]
    grads[2][::11] = 0.0
    grads[3][::13] = np.float32(-0.0)
    grads[4][100:140] = np.float32(2.0)  # ties
    assert_same(run(spec, grads, as_torch), run(spec, grads, as_torch, numpy_only=True))


@pytest.mark.parametrize("spec", ["topk", "dgc", "gaussiank"])
def test_pieces_step_the_same_as_the_fused_buffer(spec):
    rng = np.random.default_rng(11)
    grads = [rng.standard_normal(3001).astype(np.float32) for _ in range(4)]
    whole = run(spec, grads, as_torch=True, numpy_only=True)
    assert_same(run(spec, grads, as_torch=True, pieces=[1, 64, 1000, 2999]), whole)


@pytest.mark.parametrize("spec", ["topk", "dgc", "oktopk"])
def test_an_overflow_changes_nothing_with_kernels_on(spec):
    rng = np.random.default_rng(5)
    n = 2000
    compressor = horovod_sparse.create(spec)
    with compressor.make_pipeline(n, MPI.COMM_SELF) as sparsifier:
        for _ in range(3):
            sparsifier.step(rng.standard_normal(n).astype(np.float32))
        before = sparsifier.state_dict()
        bad = rng.standard_normal(n).astype(np.float32)
        bad[1234] = np.inf
        with pytest.raises(NonFiniteGradientError):
            sparsifier.step(bad)
        after = sparsifier.state_dict()
    for key in before:
        assert np.array_equal(np.asarray(before[key]), np.asarray(after[key])), key


@pytest.mark.parametrize("spec,steps,quiet_from", [("gaussiank", 120, 60), ("threshold:value=2.6", 40, 5)])
def test_the_candidate_buffers_grow_until_a_steady_step_needs_no_second_pass(spec, steps, quiet_from, monkeypatch):
    # Gaussiank collects candidates below its last threshold: once the residual has grown (from
    # step ~40 here) that is more than 4k of them, and with buffers of 4k it rescanned at every
    # step; a fixed threshold on an error-feedback residual selects ~10% of the entries, and with
    # buffers grown to exactly that it rescanned whenever the count grew by one. Each rescan is a
    # read pass of the whole buffer; once the buffers hold what the steps find and a quarter more,
    # a steady step needs none.
    from horovod_sparse.sparsify import sparsifier as module
    rescan, rescans, done = module.rescan, [], []

    def counted(*args, **kwargs):
        rescans.append(len(done))  # the step being made
        return rescan(*args, **kwargs)
    monkeypatch.setattr(module, "rescan", counted)
    rng = np.random.default_rng(17)
    n = 200_000
    with horovod_sparse.create(spec).make_pipeline(n, MPI.COMM_SELF) as sparsifier:
        for step in range(steps):
            sparsifier.step_sparse(rng.standard_normal(n).astype(np.float32))
            done.append(step)
        capacity = sparsifier._candidate_scratch.index.shape[0]
    assert [s for s in rescans if s >= quiet_from] == [], (spec, rescans)
    assert capacity <= max(n // 16 + 64, int(1.25 * 0.11 * n)), capacity  # grown, but not to the buffer


@pytest.mark.parametrize("size,k", [(1, 1), (7, 3), (500, 100), (500, 500), (5000, 1234)])
@pytest.mark.parametrize("distinct", [3, 50, 10**6])
def test_take_top_equals_numpys_compare_and_compaction(size, k, distinct):
    """The top-k among candidates: everything above the k-th key, then the lowest-indexed ties."""
    from horovod_sparse.ops.magnitude import kth_largest
    from horovod_sparse.sparsify.selection import _top_of_candidates
    rng = np.random.default_rng(size + k + distinct)
    keys = rng.integers(0, distinct, size).astype(np.int32)  # few distinct keys: many ties at the k-th
    index = np.sort(rng.choice(10 * size, size, replace=False)).astype(np.int64)
    kth = kth_largest(keys, k)
    got = _top_of_candidates(index, keys, kth, k)
    with cpu.numpy_only():
        want = _top_of_candidates(index, keys, kth, k)
    assert got.size == k and np.array_equal(got, want)


@pytest.mark.parametrize("size", [1, 2, 65, 10_000])
def test_kth_largests_equal_a_full_sort(size):
    """The k-th largest keys at several k (the next floor's and the selection's): one partition
    per k, on numpy and CPU tensors, against a full sort; ties and the extreme keys included."""
    import torch
    from horovod_sparse.ops.magnitude import kth_largests
    rng = np.random.default_rng(size)
    for keys in (rng.integers(0, 5, size).astype(np.int32), rng.integers(-2**31, 2**31, size).astype(np.int32),
                 rng.integers(0, 2**40, size).astype(np.int64)):
        ks = [size, 1, max(1, size // 3), max(1, size // 100), 1]
        want = [int(np.sort(keys)[::-1][k - 1]) for k in ks]
        assert kth_largests(keys, ks) == want
        assert kth_largests(torch.from_numpy(keys), ks) == want


@pytest.mark.parametrize("seed", range(5))
def test_sorted_membership_equals_numpy_isin(seed):
    """The local selection against the global one (Ok-Topk, gTop-k): the compiled merge and
    numpy's isin, on sorted unique indices of both widths, empty sides and full overlap."""
    from horovod_sparse.ops.indices import isin_sorted
    rng = np.random.default_rng(seed)
    cases = [(np.unique(rng.integers(0, 2000, rng.integers(0, 500))), np.unique(rng.integers(0, 2000, rng.integers(0, 500))))
             for _ in range(20)]
    cases += [(np.arange(0), np.arange(5)), (np.arange(5), np.arange(0)), (np.arange(7), np.arange(7))]
    for a, b in cases:
        for b_cast in (b, b.astype(np.int32)):
            expected = np.isin(a, b_cast)
            with cpu.numpy_only():
                assert np.array_equal(isin_sorted(a, b_cast), expected)
            assert np.array_equal(isin_sorted(a, b_cast), expected)
            assert np.array_equal(isin_sorted(torch.from_numpy(a), torch.from_numpy(b_cast)).numpy(), expected)


def _same_bits(a, b):
    """Equal arrays, bit for bit, except that a NaN matches any NaN (payloads may differ)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    nan = np.isnan(a) if a.dtype.kind == "f" else np.zeros(a.shape, bool)
    if a.dtype.kind == "f" and not np.array_equal(nan, np.isnan(b)):
        return False
    return np.array_equal(a[~nan].view(np.uint8), b[~nan].view(np.uint8))


@pytest.mark.parametrize("runs", [1, 2, 3, 4, 7, 16, 17, 40])
@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "denormals", "nonfinite"])
def test_sum_of_sorted_runs_equals_numpys_sort_and_add_at(runs, kind):
    """The exchange's sum of the ranks' pairs (TopkA, gTop-k, the regions of TopkDSA and Ok-Topk):
    the compiled merge of the sorted runs adds every index's values in the same order as the
    stable sort + np.add.at, so the same bits; duplicates inside a run, empty runs, both index
    widths, float32 and float64 values and results; past MERGED_RUNS runs, the sort itself."""
    from horovod_sparse.exchange.sparse_ops import MERGED_RUNS, sum_duplicates
    rng = np.random.default_rng(runs * 31 + len(kind))
    span = int(rng.integers(1, 400))
    pieces_i, pieces_v = [], []
    for r in range(runs):
        size = int(rng.integers(0, 60)) if r % 5 != 3 else 0
        index = np.sort(rng.integers(0, span, size))            # duplicates inside a run too
        pieces_i.append(index)
        pieces_v.append(adversarial(size, rng, kind))
    for index_dtype in (np.int32, np.int64):
        for value_dtype in (np.float32, np.float64):
            args = ([np.concatenate(pieces_i).astype(index_dtype)], [np.concatenate(pieces_v)], value_dtype)
            got = sum_duplicates(*args)
            with cpu.numpy_only():
                want = sum_duplicates(*args)
            assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1]), (index_dtype, value_dtype)
            # the same sums from the pieces given one by one (gTop-k's two, TopkDSA's regions)
            split = sum_duplicates([p.astype(index_dtype) for p in pieces_i], pieces_v, value_dtype)
            assert _same_bits(split[0], want[0]) and _same_bits(split[1], want[1])
    from horovod_sparse.ops.cpu.sparsify import sorted_runs
    joined = np.concatenate(pieces_i)
    starts = np.flatnonzero(np.diff(joined) < 0) + 1
    bounds = np.empty(MERGED_RUNS + 1, np.int64)
    counted = sorted_runs(joined, bounds)
    if starts.size + 1 <= MERGED_RUNS:
        assert counted == starts.size + 1
        assert np.array_equal(bounds[:counted + 1], np.concatenate(([0], starts, [joined.size])))
    else:
        assert counted == MERGED_RUNS + 1


def test_sum_of_sorted_runs_on_a_float64_accumulator_and_unsorted_input():
    """TopkDSA's regions keep float64 sums and add the next pieces into them; an unsorted piece
    is runs of one or more entries: either way numpy's bits."""
    from horovod_sparse.exchange.sparse_ops import sum_duplicates
    rng = np.random.default_rng(5)
    acc_i, acc_v = np.arange(0, 300, 3), rng.standard_normal(100)
    piece_i = rng.permutation(300)[:40]                            # not sorted
    piece_v = rng.standard_normal(40).astype(np.float32)
    args = ([acc_i, piece_i], [acc_v, piece_v], np.float64)
    got = sum_duplicates(*args)
    with cpu.numpy_only():
        want = sum_duplicates(*args)
    assert _same_bits(got[0], want[0]) and _same_bits(got[1], want[1])
    empty = sum_duplicates([np.empty(0, np.int64)], [np.empty(0, np.float32)], np.float32)
    assert empty[0].size == 0 and empty[1].dtype == np.float32
