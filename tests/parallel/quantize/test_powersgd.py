"""PowerSGD at P = 2, 3, 4 against a numpy oracle built from every rank's accumulated gradient.

Oracle (independent of the pipeline's code): the ranks Allgather grad + residual; with
the pipeline's Q from before the step, numpy recomputes per matrix P_i = M_i Q (rounded to
float32 as sent), sum P, orthonormalise by np.linalg.qr (signs fixed so diag(R) > 0),
Q_i = M_i^T P_orth, sum Q (float32), result = P_orth (sum Q)^T, in float64.
Tolerance: |pipeline - oracle| <= 2e-6 * max|oracle| per matrix, i.e. 17 float32 eps
(measured: about 1.7e-7; the two differ by the order of the float32 sums and Gram-Schmidt
vs Householder QR); the dense part within P float32 ulps of the sum of magnitudes.
"""
import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.exchange import ExchangeError
from horovod_sparse.layout import GradientLayout

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
EPS32 = float(np.finfo(np.float32).eps)
# Matrices (48, 36), (24, 60) and conv (16, 3, 3, 3) -> 16 x 27 are compressed at rank 2;
# (3, 4) is too small (12 < 2 * 2 * 7), biases are 1-D.
LAYOUT = GradientLayout([("w1", (48, 36), "float32"), ("b1", (36,), "float32"),
                         ("w2", (24, 60), "float32"), ("tiny", (3, 4), "float32"),
                         ("conv", (16, 3, 3, 3), "float32"), ("b2", (24,), "float32"),
                         ("scale", (), "float32")])


def all_ranks(flag):
    """True on every rank iff ``flag`` holds on every rank (so a failure fails everywhere)."""
    return bool(MPI.COMM_WORLD.allreduce(int(bool(flag)), op=MPI.MIN))


def gradient(layout, step, seed=0):
    rng = np.random.default_rng([seed, step, RANK])
    if layout is None:
        return rng.standard_normal(1000).astype(np.float32)
    return layout.fuse([rng.standard_normal(e.shape) * (1 + i) for i, e in enumerate(layout.entries)])


def gather(comm, array):
    local = np.ascontiguousarray(array, dtype=np.float32)
    out = np.empty((comm.size, local.size), np.float32)
    comm.Allgather(local, out)
    return out.astype(np.float64)


def expected_blocks(layout, rank, n):
    """(offset, size, rows, cols, r) of what must be compressed, by the rule itself."""
    if layout is None:
        a = int(np.ceil(np.sqrt(n)))
        b = -(-n // a)
        r = min(rank, a, b)
        return [(0, n, a, b, r)] if a * b >= 2.0 * r * (a + b) else []
    blocks = []
    for e in layout.entries:
        if len(e.shape) >= 2:
            a, b = e.shape[0], e.size // e.shape[0]
            r = min(rank, a, b)
            if r >= 1 and a * b >= 2.0 * r * (a + b):
                blocks.append((e.offset, e.size, a, b, r))
    return blocks


def qr_basis(m):
    q, r = np.linalg.qr(m)
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)


def as_matrix(vector, offset, size, rows, cols):
    padded = np.zeros(rows * cols)
    padded[:size] = vector[offset:offset + size]
    return padded.reshape(rows, cols)


def oracle(accs, qs, blocks, n):
    """The sum over ranks PowerSGD computes from every rank's accumulated buffer ``accs``
    (P x n) and the shared start Q's; returns (result, summed Q's) in float64."""
    result = accs.sum(axis=0)  # the dense part's exact sum; matrices overwritten below
    new_qs = []
    for (offset, size, rows, cols, r), q in zip(blocks, qs):
        q0 = qr_basis(q.astype(np.float64))
        ms = [as_matrix(acc, offset, size, rows, cols) for acc in accs]
        p_sum = sum((m @ q0).astype(np.float32).astype(np.float64) for m in ms)
        basis = qr_basis(p_sum.astype(np.float32).astype(np.float64))
        q_sum = sum((m.T @ basis).astype(np.float32).astype(np.float64) for m in ms)
        q_sum = q_sum.astype(np.float32).astype(np.float64)
        result[offset:offset + size] = (basis @ q_sum.T).ravel()[:size]
        new_qs.append(q_sum)
    return result, new_qs


def ring_bytes(elements):
    """What CountingComm counts for this rank in a ring Allreduce of float32 ``elements``."""
    own = ((RANK + 1) * elements) // SIZE - (RANK * elements) // SIZE
    return 8 * (elements - own) if elements else 0


@pytest.mark.parametrize("layout, rank, warm_start, error_feedback", [
    (LAYOUT, 2, True, True), (LAYOUT, 1, False, True), (LAYOUT, 3, True, False), (None, 2, True, True)])
def test_against_oracle(layout, rank, warm_start, error_feedback, comm, assert_identical_across_ranks):
    n = LAYOUT.n if layout is not None else 1000
    spec = horovod_sparse.create("powersgd", rank=rank, warm_start=warm_start, error_feedback=error_feedback)
    with spec.make_pipeline(n, comm, layout=layout) as pipe:
        blocks = expected_blocks(layout, rank, n)
        assert [(m.offset, m.size, m.rows, m.cols, m.rank) for m in pipe.plan.matrices] == blocks
        compressed = np.zeros(n, bool)
        for offset, size, *_ in blocks:
            compressed[offset:offset + size] = True
        for step in range(4):
            grad = gradient(layout, step)
            residual = pipe.residual.copy() if error_feedback else np.zeros(n, np.float32)
            qs = pipe.q_matrices if warm_start else [
                np.random.default_rng([0, i, step]).standard_normal((b[3], b[4])) for i, b in enumerate(blocks)]
            out = pipe.step(grad, tag=layout.tag if layout is not None else 7)
            info = pipe.last
            assert_identical_across_ranks(out)
            assert info.step == step and info.compressed_matrices == len(blocks)

            acc = grad + residual  # float32, as the pipeline adds them
            accs = gather(comm, acc)
            want, want_qs = oracle(accs, qs, blocks, n)
            for offset, size, *_ in blocks:
                got, ref = out[offset:offset + size], want[offset:offset + size]
                assert all_ranks(np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max())
            for got, ref in zip(pipe.q_matrices if warm_start else [], want_qs):
                assert all_ranks(np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max())
            dense = ~compressed
            assert all_ranks(np.all(np.abs(out[dense] - want[dense])
                                    <= SIZE * EPS32 * np.abs(accs[:, dense]).sum(axis=0)))

            # The result is the sum of what the ranks kept: to rounding on the matrices
            # (sum of float32 Q's vs their float32 MPI sum), exactly as summed on the dense part.
            kept = gather(comm, info.kept)
            total = kept.sum(axis=0)
            assert all_ranks(np.array_equal(info.kept[dense], acc[dense]))
            for offset, size, *_ in blocks:
                span = slice(offset, offset + size)
                assert all_ranks(np.abs(out[span] - total[span]).max() <= 2e-6 * np.abs(total[span]).max())
            # Residual conservation: residual = float32(acc - kept), correctly rounded.
            if error_feedback:
                a64, k64 = acc.astype(np.float64), info.kept.astype(np.float64)
                assert all_ranks(np.all(np.abs(k64 + pipe.residual - a64) <= 0.5 * EPS32 * np.abs(a64 - k64)))
            else:
                assert pipe.residual is None


def test_bytes_match_the_formula(comm):
    # Rank 2: N1 = 2*(48 + 24 + 16) + dense (36 + 12 + 24 + 1) = 249, N2 = 2*(36 + 60 + 27) = 246.
    with horovod_sparse.create("powersgd:rank=2").make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipe:
        plan = pipe.plan
        n1, n2 = plan.p_size + plan.dense_size, plan.q_size
        assert (n1, n2) == (249, 246)
        for step in range(2):
            pipe.step(gradient(LAYOUT, step), tag=LAYOUT.tag)
            t = pipe.last.traffic
            assert all_ranks(t.payload_bytes_sent == ring_bytes(n1) + ring_bytes(n2)
                             == t.payload_bytes_received)
            assert all_ranks(t.control_bytes_sent == 80 * (SIZE - 1) == t.control_bytes_received)
            assert all_ranks(t.messages_sent == 4 * (SIZE - 1) + (SIZE - 1))
        # Summed over ranks the chunks cover each buffer once: exactly 2(P-1)/P * 4 * (N1 + N2)
        # on average per rank (each rank alone when P divides N1 and N2).
        total = comm.allreduce(pipe.last.traffic.payload_bytes_sent)
        assert total == 2 * (SIZE - 1) * 4 * (n1 + n2)
    # A layout where P = 2, 3, 4 divide N1 and N2: the per-rank formula holds exactly.
    layout = GradientLayout([("w1", (48, 36), "float32"), ("b1", (36,), "float32"),
                             ("w2", (24, 60), "float32"), ("b2", (24,), "float32"),
                             ("tiny", (3, 4), "float32")])
    with horovod_sparse.create("powersgd:rank=2").make_pipeline(layout.n, comm, layout=layout) as pipe:
        pipe.step(gradient(layout, 0), tag=layout.tag)
        plan = pipe.plan
        elements = plan.p_size + plan.dense_size + plan.q_size
        assert (plan.p_size + plan.dense_size, plan.q_size) == (216, 192)
        assert sum(m.rank * (m.rows + m.cols) for m in plan.matrices) + plan.dense_size == elements
        assert all_ranks(pipe.last.traffic.payload_bytes_sent * SIZE == 2 * (SIZE - 1) * 4 * elements)


def test_state_dict_round_trip_is_bitwise(comm, assert_identical_across_ranks):
    grads = [gradient(LAYOUT, step, seed=3) for step in range(5)]
    spec = horovod_sparse.create("powersgd:rank=2")
    with spec.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipe:
        straight = [pipe.step(g, tag=LAYOUT.tag) for g in grads]
        final = pipe.state_dict()
    with spec.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipe:
        for g in grads[:2]:
            pipe.step(g, tag=LAYOUT.tag)
        saved = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in pipe.state_dict().items()}
    assert all(isinstance(v, (int, np.ndarray)) for v in saved.values())
    with spec.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipe:
        pipe.load_state_dict(saved)
        resumed = [pipe.step(g, tag=LAYOUT.tag) for g in grads[2:]]
        again = pipe.state_dict()
    assert all_ranks(all(np.array_equal(a, b) for a, b in zip(straight[2:], resumed)))
    assert all_ranks(all(np.array_equal(final[k], again[k]) for k in final))
    assert_identical_across_ranks(resumed[-1])


def _expect_error_everywhere(pipe, grad, tag, match):
    try:
        pipe.step(grad, tag=tag)
        raised = ""
    except ExchangeError as err:
        raised = str(err)
    assert all_ranks(match in raised), raised


def test_mismatches_raise_on_every_rank(comm, assert_identical_across_ranks):
    # One rank lays the same n out differently (w1 transposed): rejected everywhere.
    other = GradientLayout([("w1", (36, 48), "float32")] + [(e.key, e.shape, e.dtype) for e in LAYOUT.entries[1:]])
    layout = other if RANK == SIZE - 1 else LAYOUT
    spec = horovod_sparse.create("powersgd:rank=2")
    with spec.make_pipeline(layout.n, comm, layout=layout) as pipe:
        _expect_error_everywhere(pipe, gradient(LAYOUT, 0), 5, "ranks disagree on params")
    with spec.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipe:
        grad = gradient(LAYOUT, 0)
        pipe.step(grad, tag=LAYOUT.tag)
        before = pipe.state_dict()
        # A different tag on one rank, then a bad gradient on one rank.
        _expect_error_everywhere(pipe, grad, LAYOUT.tag + (RANK == 0), "ranks disagree on tag")
        bad = grad[:-1] if RANK == SIZE - 1 else grad
        _expect_error_everywhere(pipe, bad, LAYOUT.tag, f"rank {SIZE - 1}: invalid input")
        after = pipe.state_dict()
        assert np.array_equal(before["residual"], after["residual"]) and after["step"] == 1
        # Nothing was lost: the next good call works on every rank.
        assert_identical_across_ranks(pipe.step(grad, tag=LAYOUT.tag))
    # A different rank on one rank.
    with horovod_sparse.create("powersgd", rank=2 + (RANK == 0)).make_pipeline(
            LAYOUT.n, comm, layout=LAYOUT) as pipe:
        _expect_error_everywhere(pipe, gradient(LAYOUT, 0), 0, "ranks disagree on k")


# ------------------------------------------------------------------ torch tensors
# The same pipeline code on torch tensors. On CPU it runs numpy's kernels on zero-copy views
# (numpy_on_cpu, the default), so it must give the numpy path's bits exactly; with
# numpy_on_cpu=False it runs torch's own kernels, as on a GPU: P = M Q and Q = M^T P then go
# through another BLAS, whose float32 sums round differently, so it agrees with numpy within
# a tolerance: 1e-5 x max|result| per matrix, from the same state each step (measured: at
# most 6e-7). The orthonormalisation and the result's element-wise products are the same
# code on the same (summed) factors, so replicas stay bitwise identical on every rank.
import torch  # noqa: E402

from horovod_sparse.ops import host  # noqa: E402

# Repeated shapes, as a model's layers: torch runs a batched product per run of equally spaced
# same-shape matrices (lowrank/batched.py): w1-w3 one run (biases between), w4 a new one (another
# spacing), c1-c2 one run back to back, w5 alone.
REPEATED = GradientLayout([("w1", (24, 20), "float32"), ("b1", (20,), "float32"),
                           ("w2", (24, 20), "float32"), ("b2", (20,), "float32"),
                           ("w3", (24, 20), "float32"), ("w4", (24, 20), "float32"),
                           ("c1", (16, 3, 3, 3), "float32"), ("c2", (16, 3, 3, 3), "float32"),
                           ("w5", (24, 20), "float32"), ("b5", (24,), "float32")])
TORCH_CASES = [(LAYOUT, 2), (LAYOUT, 1), (None, 3), (REPEATED, 2), (REPEATED, 1)]


def _make(layout, rank, numpy_on_cpu=True):
    n = layout.n if layout is not None else 1000
    pipe = horovod_sparse.create("powersgd", rank=rank).make_pipeline(n, MPI.COMM_WORLD, layout=layout)
    pipe.numpy_on_cpu = numpy_on_cpu
    return pipe


def _tag(layout):
    return layout.tag if layout is not None else 7


@pytest.mark.parametrize("layout, rank", TORCH_CASES)
def test_torch_input_gives_the_numpy_bits(layout, rank, assert_identical_across_ranks):
    with _make(layout, rank) as on_numpy, _make(layout, rank) as on_torch:
        for step in range(4):
            grad = gradient(layout, step)
            expected = on_numpy.step(grad, tag=_tag(layout))
            got = on_torch.step(torch.from_numpy(grad.copy()), tag=_tag(layout))
            assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
            assert isinstance(on_torch.residual, torch.Tensor) and isinstance(on_torch.last.kept, torch.Tensor)
            assert all_ranks(np.array_equal(got.numpy().view(np.uint32), expected.view(np.uint32)))
            assert all_ranks(np.array_equal(on_torch.residual.numpy(), on_numpy.residual))
            assert all_ranks(np.array_equal(on_torch.last.kept.numpy(), on_numpy.last.kept))
            assert on_torch.last.traffic == on_numpy.last.traffic
            assert_identical_across_ranks(got.numpy())
        a, b = on_numpy.state_dict(), on_torch.state_dict()
        assert set(a) == set(b)
        assert all(isinstance(v, (int, np.ndarray)) for v in b.values())
        assert all_ranks(all(np.array_equal(np.asarray(a[k]), np.asarray(b[k])) for k in a))


@pytest.mark.parametrize("layout, rank", TORCH_CASES)
def test_torch_kernels_agree_with_numpy(layout, rank, comm, assert_identical_across_ranks):
    n = layout.n if layout is not None else 1000
    with _make(layout, rank) as on_numpy, _make(layout, rank, numpy_on_cpu=False) as on_torch:
        blocks = expected_blocks(layout, rank, n)
        dense = np.ones(n, bool)
        for offset, size, *_ in blocks:
            dense[offset:offset + size] = False
        for step in range(4):
            state = on_numpy.state_dict()
            on_torch.load_state_dict(state)  # the same start: one step's difference
            grad = gradient(layout, step)
            acc = grad + state["residual"]
            expected = on_numpy.step(grad, tag=_tag(layout))
            got = on_torch.step(torch.from_numpy(grad.copy()), tag=_tag(layout))
            assert_identical_across_ranks(got.numpy())
            got = got.numpy()
            for offset, size, *_ in blocks:
                span = slice(offset, offset + size)
                assert all_ranks(np.abs(got[span] - expected[span]).max() <= 1e-5 * np.abs(expected[span]).max())
            assert all_ranks(np.array_equal(got[dense], expected[dense]))  # the same floats summed
            # Conservation with torch's kernels: residual = float32(acc - kept), correctly rounded.
            kept, residual = on_torch.last.kept.numpy().astype(np.float64), on_torch.residual.numpy()
            a64 = acc.astype(np.float64)
            assert all_ranks(np.all(np.abs(kept + residual - a64) <= 0.5 * EPS32 * np.abs(a64 - kept)))
            assert all_ranks(np.array_equal(kept[dense], a64[dense]) and not np.any(residual[dense]))


def test_only_the_factors_cross_to_the_host(comm):
    """With torch input, what enters and leaves torch (host.HOST_TRAFFIC) is exactly the
    factors: P's and dense vector out, Q's out; orthonormal P's and the dense sum in, summed
    Q's and the next step's start Q's in (the first step uploads its own start Q's too).
    Never the gradient."""
    with _make(LAYOUT, 2) as pipe:
        plan = pipe.plan
        p, q, d = plan.p_size, plan.q_size, plan.dense_size
        for step in range(3):
            host.HOST_TRAFFIC.reset()
            pipe.step(torch.from_numpy(gradient(LAYOUT, step)), tag=LAYOUT.tag)
            traffic = host.HOST_TRAFFIC
            first = q if step == 0 else 0
            assert traffic.bytes_out == 4 * (p + d + q)
            assert traffic.bytes_in == 4 * (first + p + d + q + q)
            assert traffic.largest == 4 * max(p + d, q) < 4 * LAYOUT.n


def test_the_device_path_resumes_bit_exact(assert_identical_across_ranks):
    """Torch's own ops orthonormalise on the device, from the Q sum a step uploads; a restored
    pipeline uploads its warm-start Q's and orthonormalises them the same way: the same bits."""
    grads = [torch.from_numpy(gradient(REPEATED, step, seed=3)) for step in range(5)]
    with _make(REPEATED, 2, numpy_on_cpu=False) as pipe:
        straight = [pipe.step(g, tag=REPEATED.tag).clone() for g in grads]
    with _make(REPEATED, 2, numpy_on_cpu=False) as pipe:
        for g in grads[:2]:
            pipe.step(g, tag=REPEATED.tag)
        saved = {k: (v.clone() if isinstance(v, torch.Tensor) else np.copy(v)) for k, v in pipe.state_dict().items()}
    with _make(REPEATED, 2, numpy_on_cpu=False) as pipe:
        pipe.load_state_dict(saved)
        resumed = [pipe.step(g, tag=REPEATED.tag).clone() for g in grads[2:]]
    assert all_ranks(all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                         for a, b in zip(straight[2:], resumed)))
    assert_identical_across_ranks(resumed[-1].numpy())


def test_ranks_that_would_orthonormalise_differently_are_refused_on_every_rank(comm):
    """One rank on torch's own ops (the device path), the others on numpy's kernels: their
    orthonormal bases would differ in the last bits, so the step is refused everywhere, the
    state untouched, and the same ranks on one kind of kernels go on."""
    grad = torch.from_numpy(gradient(REPEATED, 0))
    with _make(REPEATED, 2, numpy_on_cpu=(RANK != 0)) as pipe:
        _expect_error_everywhere(pipe, grad, REPEATED.tag, "devices are of different kinds")
        assert pipe.step_count == 0
        pipe.numpy_on_cpu = False
        assert all_ranks(pipe.step(grad, tag=REPEATED.tag) is not None) and pipe.step_count == 1
