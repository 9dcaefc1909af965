"""PowerSGD on one process (MPI.COMM_SELF, P = 1): what is compressed, rank-r exactness,
subspace iteration, error feedback, state, bad parameters and bad input."""
import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.exchange import ExchangeError
from horovod_sparse.layout import GradientLayout
from horovod_sparse.lowrank import PowerSGDPipeline, make_plan
from horovod_sparse.lowrank.orthogonal import orthonormalize

EPS32 = float(np.finfo(np.float32).eps)


def low_rank(rows, cols, r, rng, scale=1.0):
    return scale * rng.standard_normal((rows, r)) @ rng.standard_normal((r, cols))


def pipeline(layout_or_n, rank=2, **kw):
    layout = layout_or_n if isinstance(layout_or_n, GradientLayout) else None
    n = layout.n if layout is not None else layout_or_n
    return PowerSGDPipeline(n, MPI.COMM_SELF, rank, layout=layout, **kw)


# ----------------------------------------------------------------------- plan
@pytest.mark.parametrize("shape, rank, compressed, r", [
    ((64, 32), 1, True, 1),          # 2048 >= 2 * 1 * 96
    ((64, 32), 4, True, 4),          # 2048 >= 2 * 4 * 96 = 768
    ((64, 32), 11, False, 11),       # 2048 < 2 * 11 * 96 = 2112
    ((16, 3, 3, 3), 1, True, 1),     # conv kernel viewed as 16 x 27
    ((3, 4), 1, False, 1),           # 12 < 2 * 7
    ((4, 4), 1, True, 1),            # 16 >= 2 * 8: the boundary counts as worth it
    ((4, 1, 1), 1, False, 1),        # thin: 4 x 1
    ((100, 2), 5, False, 2),         # rank capped at min(a, b) = 2: 200 < 2 * 2 * 102
    ((0, 5), 1, False, 0),           # empty matrix
    ((10,), 1, False, None),         # 1-D: always dense
    ((), 1, False, None),            # scalar
])
def test_which_entries_are_compressed(shape, rank, compressed, r):
    layout = GradientLayout([("before", (3,), "float32"), ("x", shape, "float32"),
                             ("after", (2,), "float32")])
    plan = make_plan(layout.n, rank, 2.0, layout)
    x = layout.entries[1]
    if compressed:
        (block,) = plan.matrices
        assert (block.key, block.offset, block.size) == ("x", x.offset, x.size)
        assert (block.rows, block.cols, block.rank) == (shape[0], x.size // shape[0], r)
        assert plan.dense_slices == ((0, 3), (x.offset + x.size, layout.n))
    else:
        assert plan.matrices == ()
        assert plan.dense_slices == (((0, layout.n),) if layout.n else ())  # merged neighbours
    assert plan.dense_size + sum(m.size for m in plan.matrices) == layout.n


def test_min_compression_rate_moves_the_boundary():
    layout = GradientLayout([("w", (64, 32), "float32")])
    assert len(make_plan(layout.n, 1, 21.3, layout).matrices) == 1   # 2048 >= 21.3 * 96
    assert len(make_plan(layout.n, 1, 21.4, layout).matrices) == 0


@pytest.mark.parametrize("n, shape, padding", [(1000, (32, 32), 24), (1024, (32, 32), 0),
                                               (1025, (33, 32), 31), (10, None, 0), (0, None, 0)])
def test_without_layout_the_buffer_is_one_near_square_matrix(n, shape, padding):
    plan = make_plan(n, 1, 2.0, None)
    if shape is None:  # 10 elements: 4 x 3 would not gain 2x, so the buffer is summed densely
        assert plan.matrices == () and plan.dense_size == n
        return
    (block,) = plan.matrices
    assert (block.rows, block.cols) == shape and block.rows * block.cols - n == padding
    assert plan.dense_size == 0 and plan.padded


# ------------------------------------------------------------- orthogonalise
def test_gram_schmidt_matches_qr_with_positive_diagonal_and_zeroes_zero_columns():
    rng = np.random.default_rng(0)
    m = rng.standard_normal((50, 4))
    basis, zeros = orthonormalize(m)
    q, r = np.linalg.qr(m)
    q = q * np.sign(np.diag(r))
    assert zeros == 0 and np.allclose(basis, q, atol=1e-12)
    m[:, 2] = 0.0
    basis, zeros = orthonormalize(m)
    assert zeros == 1 and np.all(basis[:, 2] == 0) and np.all(np.isfinite(basis))


# ------------------------------------------------------------- exactness
LAYOUT = GradientLayout([("w1", (48, 40), "float32"), ("b1", (40,), "float32"),
                         ("conv", (12, 3, 3, 3), "float32"), ("tiny", (3, 4), "float32")])


class RankR:
    """Gradients U_t C_t V^T of rank r with fixed U, V and a fresh r x r core C_t per step."""

    def __init__(self, r, seed):
        self.rng = np.random.default_rng(seed)
        self.r = r
        self.factors = [(self.rng.standard_normal((a, r)), self.rng.standard_normal((b, r)), scale)
                        for a, b, scale in ((48, 40, 1.0), (12, 27, 0.01))]

    def matrix(self, i):
        u, v, scale = self.factors[i]
        return scale * u @ self.rng.standard_normal((self.r, self.r)) @ v.T

    def __call__(self, fresh=False):
        if fresh:  # new column and row spaces too
            self.__init__(self.r, int(self.rng.integers(2**31)))
        return LAYOUT.fuse([self.matrix(0), self.rng.standard_normal(40), self.matrix(1),
                            self.rng.standard_normal((3, 4))])


def assert_reconstructed(out, grad):
    for got, want in zip(LAYOUT.split(out), LAYOUT.split(grad)):
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()
    assert np.array_equal(LAYOUT.split(out)[1], LAYOUT.split(grad)[1])


@pytest.mark.parametrize("warm_start", [True, False])
@pytest.mark.parametrize("r", [1, 3])
def test_rank_r_gradients_are_reconstructed(r, warm_start):
    # Guarantee. When the accumulated matrix M has rank <= r, span(M Q) is its column
    # space for a generic Q, so P_orth P_orth^T M = M in exact arithmetic; in float32 the
    # error grows with the conditioning of V^T Q (V: M's row space). So:
    # * the first step, from a random Q, reconstructs any rank-r matrix;
    # * with warm start and gradients whose row space stays put (here U C_t V^T, any
    #   core C_t), the summed Q spans V, and every step reconstructs to float32
    #   accuracy: |result - grad| <= 1e-5 max|grad| per matrix; the residual stays at
    #   rounding size, so error feedback has nothing to add;
    # * without warm start every step is a first step.
    # The dense part (b1, and tiny: 12 < 2 * 7 elements) is exact at P = 1.
    # (Fresh rank-r gradients in NEW spaces each step with a warm Q are not covered:
    # V_t^T Q_{t-1} can be ill-conditioned, and rounding-level residuals then grow.)
    gradients = RankR(r, seed=r)
    with pipeline(LAYOUT, rank=r, warm_start=warm_start) as p:
        assert [b.key for b in p.plan.matrices] == ["w1", "conv"]
        for step in range(6):
            grad = gradients()
            assert_reconstructed(p.step(grad, tag=LAYOUT.tag), grad)
            assert np.abs(p.residual).max() <= 1e-5 * np.abs(grad).max()
            assert p.last.compressed_matrices == 2 and p.last.step == step


@pytest.mark.parametrize("r", [1, 3])
def test_first_step_reconstructs_any_rank_r_gradient(r):
    for seed in range(5):
        grad = RankR(r, seed=100 + seed)(fresh=True)
        with pipeline(LAYOUT, rank=r, seed=seed) as p:
            assert_reconstructed(p.step(grad), grad)


def test_warm_start_without_error_feedback_is_subspace_iteration():
    # A fixed gradient, no error feedback: step t is step t of subspace iteration, so the
    # result converges to the best rank-r approximation (truncated SVD) at rate
    # (sigma_{r+1} / sigma_r)^t = (1/5)^t here.
    rng = np.random.default_rng(7)
    u, _ = np.linalg.qr(rng.standard_normal((60, 6)))
    v, _ = np.linalg.qr(rng.standard_normal((50, 6)))
    sigma = np.array([10.0, 5.0, 1.0, 0.5, 0.2, 0.1])
    g = ((u * sigma) @ v.T).astype(np.float32)
    best = (u[:, :2] * sigma[:2]) @ v[:, :2].T
    layout = GradientLayout([("g", g.shape, "float32")])
    with pipeline(layout, rank=2, error_feedback=False) as p:
        assert p.residual is None
        errors = [np.abs(p.step(g.ravel()) - best.ravel()).max() for _ in range(12)]
    assert errors[-1] <= 1e-5 * sigma[0]
    assert errors[0] > errors[-1]


def test_kept_plus_residual_is_the_accumulated_gradient():
    rng = np.random.default_rng(3)
    with pipeline(LAYOUT, rank=1) as p:
        residual = np.zeros(LAYOUT.n, np.float32)
        for _ in range(3):
            grad = LAYOUT.fuse([rng.standard_normal(e.shape) for e in LAYOUT.entries])
            out = p.step(grad)
            acc = (grad + residual).astype(np.float64)  # the float32 sum the pipeline uses
            kept = p.last.kept.astype(np.float64)
            # residual = float32(acc - kept): correctly rounded, so within half an ulp.
            assert np.all(np.abs(kept + p.residual - acc) <= 0.5 * EPS32 * np.abs(acc - kept))
            # P = 1: the result is this rank's kept (computed without BLAS, so to rounding).
            assert np.allclose(out, kept, rtol=1e-6, atol=1e-6 * np.abs(kept).max())
            residual = p.residual.copy()
            assert p.last.traffic.total_bytes == 0  # nothing moves at P = 1


def test_zero_gradient_gives_zero_and_warm_start_recovers():
    with pipeline(LAYOUT, rank=2, error_feedback=False) as p:
        out = p.step(np.zeros(LAYOUT.n, np.float32))
        assert np.array_equal(out, np.zeros(LAYOUT.n, np.float32))
        assert all(np.all(q == 0) for q in p.q_matrices)  # summed Q of a zero gradient
        grad = RankR(2, seed=4)()  # a zero Q is redrawn: still exact
        assert np.abs(p.step(grad) - grad).max() <= 1e-5 * np.abs(grad).max()


def test_buffer_without_layout_and_empty_buffer():
    rng = np.random.default_rng(5)
    g = low_rank(30, 33, 1, rng).ravel()[:987].astype(np.float32)  # 32 x 31 + 5 padding
    with pipeline(987, rank=1) as p:
        assert p.plan.padded and (p.plan.matrices[0].rows, p.plan.matrices[0].cols) == (32, 31)
        out = p.step(g)
        acc = g.astype(np.float64)
        assert out.shape == (987,) and np.all(np.isfinite(out))
        assert np.all(np.abs(p.last.kept + p.residual.astype(np.float64) - acc)
                      <= 0.5 * EPS32 * np.abs(acc - p.last.kept))
    with pipeline(0, rank=1) as p:
        assert p.step(np.empty(0, np.float32)).shape == (0,)


def test_state_dict_round_trip_is_bitwise():
    rng = np.random.default_rng(6)
    grads = [LAYOUT.fuse([rng.standard_normal(e.shape) for e in LAYOUT.entries]) for _ in range(5)]
    with pipeline(LAYOUT) as p:
        straight = [p.step(g) for g in grads]
    with pipeline(LAYOUT) as p:
        for g in grads[:2]:
            p.step(g)
        state = p.state_dict()
    assert all(isinstance(v, (int, np.ndarray)) for v in state.values())
    with pipeline(LAYOUT) as p:
        p.load_state_dict(state)
        resumed = [p.step(g) for g in grads[2:]]
    assert all(np.array_equal(a, b) for a, b in zip(straight[2:], resumed))
    with pipeline(LAYOUT, rank=3) as other, pytest.raises(ValueError, match="params"):
        other.load_state_dict(state)


# ----------------------------------------------------------- bad parameters
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_bad_rank(value):
    with pytest.raises(ValueError, match="rank"):
        horovod_sparse.create("powersgd", rank=value)
    with pytest.raises(ValueError, match="rank"):
        PowerSGDPipeline(10, MPI.COMM_SELF, value)


@pytest.mark.parametrize("name, value", [("min_compression_rate", 0), ("min_compression_rate", float("nan")),
                                         ("error_feedback", 1), ("warm_start", None), ("seed", -1)])
def test_bad_parameters_name_themselves(name, value):
    with pytest.raises(ValueError, match=name):
        horovod_sparse.create("powersgd", **{name: value})


def test_registered_with_defaults_and_spec():
    assert "powersgd" in horovod_sparse.available()
    c = horovod_sparse.create("powersgd")
    assert c.params == dict(rank=2, error_feedback=True, warm_start=True, min_compression_rate=2.0, seed=0,
                            warmup_steps=0)  # the tests' conftest turns the warm-up off
    assert horovod_sparse.create(c.spec).params == c.params
    assert horovod_sparse.create("powersgd:rank=4,warm_start=false").params["rank"] == 4
    with pytest.raises(ValueError, match="layout"):
        c.make_pipeline(LAYOUT.n + 1, MPI.COMM_SELF, layout=LAYOUT)
    with c.make_pipeline(LAYOUT.n, MPI.COMM_SELF, layout=LAYOUT) as p:
        assert isinstance(p, PowerSGDPipeline) and p.approx_rank == 2


@pytest.mark.parametrize("bad", [np.zeros(LAYOUT.n + 1, np.float32), np.zeros((2, 5), np.float32),
                                 np.zeros(LAYOUT.n, np.int32)])
def test_bad_input_raises_exchange_error_and_keeps_state(bad):
    rng = np.random.default_rng(8)
    with pipeline(LAYOUT) as p:
        p.step(LAYOUT.fuse([rng.standard_normal(e.shape) for e in LAYOUT.entries]))
        before = p.state_dict()
        with pytest.raises(ExchangeError, match="invalid input"):
            p.step(bad)
        with pytest.raises(ExchangeError, match="tag"):
            p.step(np.zeros(LAYOUT.n, np.float32), tag="x")
        after = p.state_dict()
        assert after["step"] == before["step"] == 1 and after["calls"] == before["calls"] + 2
        assert np.array_equal(after["residual"], before["residual"])
        assert all(np.array_equal(after[f"q_{i}"], before[f"q_{i}"]) for i in range(before["q_count"]))
    p.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        p.step(np.zeros(LAYOUT.n, np.float32))
