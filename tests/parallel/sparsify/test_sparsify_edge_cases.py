"""Degenerate inputs: n = 0, n < P, k >= n, empty selections, zeros, NaN, tag mismatch, warm-up."""
import numpy as np
import pytest
from mpi4py import MPI

import horovod_sparse
from horovod_sparse.exchange import ExchangeError, NonFiniteGradientError
from sparsify_oracles import (RANK, SIZE, all_ranks, bitwise_equal, gradient, on_every_rank,
                              rank_ordered_sum, union_of)

SPECS = ["topk:density=0.1", "topk:density=0.1,exchange=oktopk", "topk:density=0.1,exchange=gtopk",
         "topk:density=0.1,exchange=dsa", "oktopk:density=0.1,tau_prime=2",
         "oktopk:density=0.1,warmup_steps=1", "gtopk:density=0.1", "gaussiank:density=0.1",
         "gaussiank:density=0.1,exchange=dsa", "threshold:value=0.5",
         "threshold:value=0.5,exchange=dsa", "dgc:density=0.1,sample_fraction=0.1",
         "dgc:density=0.1,sample_fraction=0.1,exchange=dsa"]


def run_steps(spec, comm, grads, tag=0):
    """Run the grads through a fresh sparsifier; return outputs and the sparsifier's last infos."""
    n = grads[0].size
    outputs, infos = [], []
    with horovod_sparse.create(spec).make_pipeline(n, comm) as sparsifier:
        for grad in grads:
            outputs.append(sparsifier.step(grad, tag=tag))
            infos.append(sparsifier.last)
        residual = sparsifier.residual.copy()
    return outputs, infos, residual


@pytest.mark.parametrize("spec", SPECS)
def test_empty_buffer(spec, comm, assert_identical_across_ranks):
    outputs, infos, residual = run_steps(spec, comm, [np.empty(0, np.float32)] * 3)

    def checks():
        for out, info in zip(outputs, infos):
            assert out.dtype == np.float32 and out.shape == (0,)
            assert info.local_indices.size == 0 and info.selected.size == 0
        assert residual.shape == (0,)

    on_every_rank(checks)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("n", [1, 2])
def test_buffer_smaller_than_p_and_k_at_least_n(spec, n, comm, assert_identical_across_ranks):
    grads = [np.full(n, RANK + 1.0 + step, np.float32) for step in range(3)]
    outputs, infos, _ = run_steps(spec, comm, grads)
    for out, info in zip(outputs, infos):
        oracle = rank_ordered_sum(n, info.cleared_indices, info.kept_values)
        assert all_ranks(np.allclose(out, oracle, rtol=1e-6))
        assert_identical_across_ranks(out)
    # k = max(1, ceil(0.1 n)) = 1: one entry per rank, at most 2k by an estimated threshold,
    # all n on a dense warm-up step.
    first = infos[0].local_indices.size
    if "warmup" in spec:
        assert all_ranks(first == n)
    elif spec.startswith(("gaussiank", "dgc")):
        assert all_ranks(1 <= first <= 2)
    elif not spec.startswith("threshold"):
        assert all_ranks(first == 1)


@pytest.mark.parametrize("spec", ["topk:density=1.0", "topk:density=1.0,exchange=oktopk",
                                  "topk:density=1.0,exchange=dsa", "gtopk:density=1.0",
                                  "oktopk:density=1.0", "gaussiank:density=1.0",
                                  "dgc:density=1.0,sample_fraction=1.0"])
def test_density_one_is_a_dense_sum(spec, comm, assert_identical_across_ranks):
    n = 200
    grads = [gradient(n, step, RANK) for step in range(3)]
    outputs, infos, residual = run_steps(spec, comm, grads)
    for out, info in zip(outputs, infos):
        oracle = rank_ordered_sum(n, info.cleared_indices, info.kept_values)
        assert all_ranks(np.allclose(out, oracle, rtol=1e-5, atol=1e-6))
        # k = n: every rule, estimated thresholds included, sends everything.
        assert all_ranks(np.array_equal(info.local_indices, np.arange(n)))
        assert_identical_across_ranks(out)
    # ... and the exchanges that select nothing globally consume it all. (Ok-Topk's global
    # threshold is exact only every tau_prime calls; in between it may take 0.8k of the n.)
    if "oktopk" not in spec:
        assert all_ranks(not np.any(residual))


@pytest.mark.parametrize("spec", SPECS)
def test_all_zero_gradients(spec, comm, assert_identical_across_ranks):
    n = 300
    outputs, infos, residual = run_steps(spec, comm, [np.zeros(n, np.float32)] * 3)
    for out in outputs:
        assert all_ranks(not np.any(out))
        assert_identical_across_ranks(out)
    assert all_ranks(not np.any(residual))


@pytest.mark.parametrize("spec", SPECS)
def test_one_rank_selects_nothing_or_has_zero_gradient(spec, comm, assert_identical_across_ranks):
    n = 400
    quiet = SIZE - 1  # this rank's gradient is zero, or below the threshold everywhere
    grads = []
    for step in range(4):
        grad = gradient(n, step, RANK)
        if RANK == quiet:
            grad = np.zeros(n, np.float32) if step % 2 else np.full(n, 1e-3, np.float32)
        grads.append(grad)
    outputs, infos, _ = run_steps(spec, comm, grads)
    for out, info in zip(outputs, infos):
        oracle = rank_ordered_sum(n, info.cleared_indices, info.kept_values)

        def checks():
            if spec.startswith("threshold") and RANK == quiet:
                assert info.local_indices.size == 0  # below 0.5 everywhere: an empty selection
            assert np.allclose(out[info.selected], oracle[info.selected], rtol=1e-5, atol=1e-5)
            assert np.all(out[np.setdiff1d(np.arange(n), info.selected)] == 0)

        on_every_rank(checks)
        assert_identical_across_ranks(out)


@pytest.mark.parametrize("spec", SPECS)
def test_nan_gradient_skips_the_step_on_every_rank(spec, comm, assert_identical_across_ranks):
    """A NaN on rank 0 (a loss scaler's overflow): every rank raises NonFiniteGradientError, in
    the warm-up's dense exchange too, no state changes, and the next steps go on."""
    n = 500
    grads = [gradient(n, step, RANK) for step in range(3)]
    with horovod_sparse.create(spec).make_pipeline(n, comm) as sparsifier:
        bad = grads[0].copy()
        if RANK == 0:
            bad[17] = np.nan
        with pytest.raises(NonFiniteGradientError):
            sparsifier.step(bad)
        assert sparsifier.step_count == 0 and not np.any(sparsifier.residual)
        outputs = [sparsifier.step(grad) for grad in grads]
    for out in outputs:
        assert np.isfinite(out).all()
        assert_identical_across_ranks(out)
    assert outputs[0].tolist() == run_steps(spec, comm, grads[:1])[0][0].tolist()


@pytest.mark.skipif(SIZE == 1, reason="needs two ranks to disagree")
@pytest.mark.parametrize("spec", ["topk:density=0.1", "oktopk:density=0.1", "gtopk:density=0.1",
                                  "oktopk:density=0.1,warmup_steps=2", "dgc:density=0.1"])
def test_tag_mismatch_raises_everywhere_and_changes_nothing(spec, comm):
    n = 300
    with horovod_sparse.create(spec).make_pipeline(n, comm) as sparsifier:
        sparsifier.step(gradient(n, 0, RANK), tag=7)
        before = sparsifier.state_dict()
        with pytest.raises(ExchangeError, match=r"ranks disagree on tag \(rank 0: 7, rank 1: 8"):
            sparsifier.step(gradient(n, 1, RANK), tag=7 + (RANK == 1))
        after = sparsifier.state_dict()

        def unchanged():
            assert sparsifier.step_count == 1 and sparsifier.last.step == 0
            for key in ("memory_residual", "memory_velocity", "rule_threshold",
                        "rule_has_threshold"):
                if key in before:
                    assert bitwise_equal(np.asarray(after[key]), np.asarray(before[key])), key

        on_every_rank(unchanged)
        out = sparsifier.step(gradient(n, 1, RANK), tag=7)  # and it goes on
        assert all_ranks(out.shape == (n,))


def test_wrong_gradient_length_is_refused_locally(comm):
    with horovod_sparse.create("topk").make_pipeline(10, comm) as sparsifier:
        for bad in (np.zeros(11, np.float32), np.zeros((2, 5), np.float32), np.zeros(10, np.int32)):
            with pytest.raises(ValueError, match="grad must be a 1-D float array of length n=10"):
                sparsifier.step(bad)


@pytest.mark.parametrize("warmup_steps", [1, 3])
def test_oktopk_warmup_sends_everything_densely_and_clears_the_residual(warmup_steps, comm,
                                                                       assert_identical_across_ranks):
    n = 1000
    compressor = horovod_sparse.create("oktopk", density=0.01, warmup_steps=warmup_steps)
    with compressor.make_pipeline(n, comm) as sparsifier:
        for step in range(warmup_steps + 2):
            grad = gradient(n, step, RANK)
            acc = grad + sparsifier.residual
            out = sparsifier.step(grad)
            info = sparsifier.last
            total = np.empty(n, np.float64)
            comm.Allreduce(acc.astype(np.float64), total)  # an independent dense sum

            def checks():
                if step < warmup_steps:
                    assert info.method == "dense" and info.local_indices.size == n
                    assert not np.any(sparsifier.residual)
                    assert np.allclose(out, total, rtol=1e-5, atol=1e-6)
                    assert info.traffic.payload_bytes_sent > 0 or SIZE == 1
                else:
                    assert info.method != "dense" and info.local_indices.size <= 2 * 10

            on_every_rank(checks)
            assert_identical_across_ranks(out)


def test_error_feedback_off_keeps_the_residual_zero_and_drops_the_rest(comm):
    n = 500
    compressor = horovod_sparse.create("topk", density=0.02, error_feedback=False)
    with compressor.make_pipeline(n, comm) as sparsifier:
        grad = gradient(n, 0, RANK)
        sparsifier.step(grad)
        sparsifier.step(grad)
        assert all_ranks(not np.any(sparsifier.residual))
        # Without memory the same gradient gives the same selection again.
        top = np.sort(np.argsort(-np.abs(grad), kind="stable")[:10])
        assert all_ranks(np.array_equal(sparsifier.last.local_indices, top))


def test_residual_carries_unsent_entries_to_later_steps(comm):
    # A constant gradient with k = 1: error feedback sends every coordinate in turn.
    n, steps = 4, 8
    compressor = horovod_sparse.create("topk", density=0.25)
    with compressor.make_pipeline(n, comm) as sparsifier:
        grad = np.array([4.0, 3.0, 2.0, 1.0], np.float32)
        kept_total = np.zeros(n, np.float64)
        for _ in range(steps):
            sparsifier.step(grad)
            kept_total[sparsifier.last.cleared_indices] += sparsifier.last.kept_values
        # Every coordinate was sent at some point, and nothing was lost:
        # everything kept + what is still in the residual == every gradient added up.
        assert all_ranks(np.all(kept_total > 0))
        assert all_ranks(np.allclose(kept_total + sparsifier.residual, steps * grad))


def test_single_rank_communicator_is_the_identity_on_what_was_sent():
    n = 300

    def checks():
        for spec in SPECS:
            with horovod_sparse.create(spec).make_pipeline(n, MPI.COMM_SELF) as sparsifier:
                for step in range(3):
                    out = sparsifier.step(gradient(n, step, RANK))
                    info = sparsifier.last
                    expected = np.zeros(n, np.float32)
                    expected[info.cleared_indices] = info.kept_values
                    assert np.array_equal(out, expected), spec
                    assert sparsifier.traffic.total_bytes == 0

    on_every_rank(checks)


def test_union_is_what_allgather_selects(comm):
    n = 800
    with horovod_sparse.create("gaussiank", density=0.05).make_pipeline(n, comm) as sparsifier:
        sparsifier.step(gradient(n, 0, RANK, "heavy"))
        union = union_of(sparsifier.last.local_indices)
        assert all_ranks(np.array_equal(sparsifier.last.selected, union))
