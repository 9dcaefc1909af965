"""PowerSGD's runs of same-shape matrices (lowrank/batched.py): which matrices share a run, and
that the batched products give what the per-matrix code gives (the result's and residual's
products bit for bit; P and Q within float32 rounding of numpy's float64 products)."""
import numpy as np
import pytest
import torch

from horovod_sparse.layout import GradientLayout
from horovod_sparse.lowrank import batched, make_plan
from horovod_sparse.lowrank.factors import BlockView, expand_block, transposed
from horovod_sparse.lowrank.powersgd import _factor_spans

EPS32 = float(np.finfo(np.float32).eps)


def runs_of(entries, rank=2):
    layout = GradientLayout([(f"e{i}", shape, "float32") for i, shape in enumerate(entries)])
    plan = make_plan(layout.n, rank, 2.0, layout)
    return plan, batched.make_runs(_factor_spans(plan))


def test_equally_spaced_same_shapes_share_a_run():
    # w w w at distance 500 (a bias between), then w at another distance, two convs back to back,
    # a last w: the factors lie by shape (the w's, then the convs), so the last two w's are a run too
    plan, (runs, rest) = runs_of([(24, 20), (20,), (24, 20), (20,), (24, 20), (24, 20),
                                  (16, 3, 3, 3), (16, 3, 3, 3), (24, 20)])
    assert rest == []
    assert [(r.offset, r.stride, r.count, r.rows, r.cols) for r in runs] == [
        (0, 500, 3, 24, 20), (1480, 1344, 2, 24, 20), (1960, 432, 2, 16, 27)]
    # the runs cover every matrix, once, and their factors are back to back in plan order
    assert sum(r.count for r in runs) == len(plan.matrices)
    assert runs[0].p == slice(0, 3 * 24 * 2) and runs[1].p.start == runs[0].p.stop
    assert runs[0].q == slice(0, 3 * 20 * 2) and runs[2].q.start == runs[1].q.stop


def test_same_shapes_apart_share_a_run_and_a_dense_entry_only_spaces_one():
    # (24, 20), (30, 30), (24, 20): the two (24, 20) are one run (their factors side by side)
    plan, (runs, _) = runs_of([(24, 20), (30, 30), (24, 20)])
    assert [(r.rows, r.cols, r.count, r.stride) for r in runs] == [(24, 20, 2, 1380), (30, 30, 1, 900)]
    spans = _factor_spans(plan)  # in plan order, placed by shape
    assert [(p.start, q.start) for _, p, q in spans] == [(0, 0), (2 * 48, 2 * 40), (48, 40)]
    # (2, 100) is too thin to compress at rank 2 (200 < 2 * 2 * 102): dense, between two of a run
    _, (runs, _) = runs_of([(24, 20), (2, 100), (24, 20)])
    assert [(r.offset, r.stride, r.count) for r in runs] == [(0, 680, 2)]


def test_a_padded_matrix_is_left_to_the_per_matrix_code():
    plan = make_plan(1000, 2, 2.0)  # no layout: one 32 x 32 matrix with 24 elements of padding
    runs, rest = batched.make_runs(_factor_spans(plan))
    assert runs == [] and [block for block, *_ in rest] == list(plan.matrices)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rank", [1, 3])
@pytest.mark.parametrize("subtract", [False, True])
def test_batched_products_agree_with_the_per_matrix_code(rank, subtract, device):
    plan, (runs, rest) = runs_of([(24, 20), (20,), (24, 20), (20,), (24, 20), (16, 3, 3, 3), (16, 3, 3, 3)], rank)
    assert rest == [] and len(runs) == 2
    rng = np.random.default_rng(0)
    flat = torch.from_numpy(rng.standard_normal(plan.n).astype(np.float32)).to(device)
    q = torch.from_numpy(rng.standard_normal(plan.q_size).astype(np.float32)).to(device)
    p, q_back = torch.empty(plan.p_size, device=device), torch.empty(plan.q_size, device=device)
    for run in runs:
        m = batched.matrices(flat, run)
        batched.project(torch, m, batched.factor(q, run.q, run, run.cols), batched.factor(p, run.p, run, run.rows))
        batched.back_project(torch, m, batched.factor(p, run.p, run, run.rows),
                             batched.factor(q_back, run.q, run, run.cols))
    spans = _factor_spans(plan)
    host = {name: x.cpu().numpy() for name, x in (("flat", flat), ("q", q), ("p", p), ("q_back", q_back))}
    for block, p_span, q_span in spans:  # P = M Q and Q = M^T P, against numpy in float64
        m = host["flat"][block.offset:block.offset + block.size].reshape(block.rows, block.cols).astype(np.float64)
        want_p = m @ host["q"][q_span].reshape(block.cols, -1)
        got_p = host["p"][p_span].reshape(block.rows, -1)
        assert np.abs(got_p - want_p).max() <= 8 * block.cols * EPS32 * np.abs(m).max() * np.abs(host["q"]).max()
        want_q = m.T @ got_p.astype(np.float64)
        got_q = host["q_back"][q_span].reshape(block.cols, -1)
        assert np.abs(got_q - want_q).max() <= 8 * block.rows * EPS32 * np.abs(m).max() * np.abs(got_p).max()
    # the result (or residual) products: the per-matrix code's bits exactly
    by_runs, by_matrix = flat.clone(), flat.clone()
    scratch = (torch.empty(plan.n, device=device), torch.empty(plan.n, device=device))
    for run in runs:
        batched.expand(torch, batched.matrices(by_runs, run), batched.factor(p, run.p, run, run.rows),
                       batched.factor(q_back, run.q, run, run.cols), scratch, subtract)
    for block, p_span, q_span in spans:
        expand_block(torch, BlockView(by_matrix, block), transposed(p[p_span].view(block.rows, -1)),
                     transposed(q_back[q_span].view(block.cols, -1)), scratch, block.size, subtract=subtract)
    assert torch.equal(by_runs.view(torch.int32), by_matrix.view(torch.int32))
    if not subtract:  # the biases between the matrices are untouched
        assert torch.equal(by_runs[480:500], flat[480:500])


def test_chunks_cover_a_run_within_the_scratch():
    run = batched.Run(0, 100, 10, 10, 10, 1, slice(0, 100), slice(0, 100))
    pieces = batched.chunks(run, 350)
    assert pieces == [(0, 3), (3, 3), (6, 3), (9, 1)]
    assert batched.scratch_elements([run], 350) == 300
    assert batched.chunks(run, 50) == [(i, 1) for i in range(10)]  # at least one matrix per launch


@pytest.mark.parametrize("device", DEVICES)
def test_the_batched_gram_schmidt_agrees_with_the_float64_one(device):
    """orthonormalize_batched (the device's, float32, a run at once) against orthonormalize
    (the host's, float64), matrix by matrix: within float32 rounding on well-conditioned
    matrices, also tiny and huge ones (the norms are scaled, so squares neither underflow nor
    overflow); a zero column stays zero; a NaN propagates instead of being zeroed."""
    from horovod_sparse.lowrank.orthogonal import orthonormalize, orthonormalize_batched
    rng = np.random.default_rng(1)
    batch = rng.standard_normal((6, 50, 3)).astype(np.float32)
    batch[1] *= np.float32(1e-30)
    batch[2] *= np.float32(1e30)
    batch[3, :, 1] = 0
    batch[4, 7, 2] = np.nan
    got = orthonormalize_batched(torch, torch.from_numpy(batch.copy()).to(device)).cpu().numpy()
    for i in (0, 1, 2, 3, 5):
        want, zero_columns = orthonormalize(batch[i])
        assert np.abs(got[i] - want).max() <= 16 * EPS32, i
        assert np.all(got[i] == 0, axis=0).sum() == zero_columns == (1 if i == 3 else 0)
        assert np.abs(got[i].T @ got[i] - np.diag(np.any(got[i] != 0, axis=0))).max() <= 32 * EPS32
    assert np.isnan(got[4][:, 2]).all() and np.isfinite(got[4][:, :2]).all()
