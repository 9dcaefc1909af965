"""Every sparsifying compressor and exchange, 5 steps on different data per rank, against oracles.

Per step: the accumulation and local selection match a from-scratch recomputation, the
conservation law holds bitwise, the result equals the sum over ranks of what each rank
kept (computed independently with MPI), every rank gets the same bytes, counts are
within their documented bounds and the traffic within the exchange's. A state_dict
taken mid-run and loaded into a fresh sparsifier continues bitwise identically.
"""
import copy
import math

import numpy as np
import pytest

import horovod_sparse
from sparsify_oracles import (PAIR_BYTES, RANK, SIZE, VALUE_BYTES, all_ranks, allreduce_sum,
                              bitwise_equal, brute_top_k, count_bounds, expected_accumulation,
                              gradient, on_every_rank, rank_ordered_sum, union_of)

N = 3000
STEPS = 5
SNAPSHOT_AFTER = 2  # state_dict taken after this many steps, replayed from there

CONFIGS = [
    ("topk", dict(density=0.02, exchange="allgather")),
    ("topk", dict(density=0.02, exchange="oktopk")),
    ("topk", dict(density=0.02, exchange="gtopk")),
    ("topk", dict(density=0.02, exchange="dsa")),
    ("topk", dict(density=0.02, error_feedback=False)),
    ("topk", dict(density=0.02, warmup_steps=2)),   # 2 dense steps, 2 of ramp (k 424, then 60): the
    ("topk", dict(density=0.02, exchange="dsa", warmup_steps=2)),   # snapshot falls between them
    ("topk", dict(density=0.2, warmup_steps=2)),   # the ramp's first step goes dense from P = 3 (k P >= N)
    ("oktopk", dict(density=0.02)),
    ("oktopk", dict(density=0.02, tau=2, tau_prime=2, warmup_steps=1)),
    ("gtopk", dict(density=0.02)),
    ("gaussiank", dict(density=0.02, exchange="allgather")),
    ("gaussiank", dict(density=0.02, exchange="dsa")),
    ("threshold", dict(value=1.5, exchange="allgather")),
    ("threshold", dict(value=1.5, exchange="dsa")),
    ("dgc", dict(density=0.01, momentum=0.9, sample_fraction=0.05, exchange="allgather")),
    ("dgc", dict(density=0.01, momentum=0.5, sample_fraction=0.05, exchange="dsa")),
]


def exchange_of(compressor):
    return {"oktopk": "oktopk", "gtopk": "gtopk"}.get(compressor.name,
                                                     getattr(compressor, "exchange", None))


def config_id(config):
    name, params = config
    return name + "-" + "-".join(f"{k}={v}" for k, v in params.items())


def check_local_selection(compressor, sparsifier, info, acc, k):
    """The local selection is the compressor's rule applied to acc (brute force where exact)."""
    local = info.local_indices
    assert local.dtype == np.int64 and np.all(np.diff(local) > 0)
    if info.method == "dense":
        assert np.array_equal(local, np.arange(N))
    elif compressor.name in ("topk", "gtopk"):
        assert np.array_equal(local, brute_top_k(acc, k))
    elif compressor.name == "threshold":
        assert np.array_equal(local, np.flatnonzero(np.abs(acc) >= np.float32(compressor.value)))
    else:  # gaussiank, dgc, oktopk: estimated thresholds
        lower, upper = count_bounds(k)
        assert lower <= local.size <= upper, (local.size, lower, upper)
        if info.method == "exact":
            assert np.array_equal(local, brute_top_k(acc, k))
        else:  # a threshold set: nothing left out is larger than what was taken
            rest = np.setdiff1d(np.arange(N), local)
            assert np.abs(acc[rest]).max() < np.abs(acc[local]).min()
    assert bitwise_equal(info.sent_values, acc[local])


def check_conservation(info, acc, new_residual, error_feedback):
    """kept (acc at the cleared indices) + new residual == acc, exactly."""
    cleared = info.cleared_indices
    assert bitwise_equal(info.kept_values, acc[cleared])
    if not error_feedback:
        assert not np.any(new_residual)
        return
    untouched = np.ones(N, bool)
    untouched[cleared] = False
    assert bitwise_equal(new_residual[untouched], acc[untouched])
    assert bitwise_equal(new_residual[cleared], np.zeros(cleared.size, np.float32))
    kept_dense = np.zeros(N, np.float32)
    kept_dense[cleared] = info.kept_values
    assert np.array_equal(kept_dense + new_residual, acc)


def check_traffic(exchange, info, all_counts, k, warmup):
    """Per-step traffic of this rank within the exchange's bound (engine counters)."""
    t = info.traffic
    mine, total = int(all_counts[RANK]), int(all_counts.sum())
    if SIZE == 1:
        assert t.total_bytes == 0
    elif warmup:  # dense ring allreduce of n values
        own = (RANK + 1) * N // SIZE - RANK * N // SIZE
        assert t.payload_bytes_sent == 2 * (N - own) * VALUE_BYTES
    elif exchange == "allgather":  # TopkA: my pairs to P-1 ranks, everyone else's pairs in
        assert t.payload_bytes_sent == mine * (SIZE - 1) * PAIR_BYTES
        assert t.payload_bytes_received == (total - mine) * PAIR_BYTES
    elif exchange == "dsa":  # reduce at the owners, then each region sparse or dense
        region = math.ceil(N / SIZE)
        assert t.payload_bytes_sent <= mine * PAIR_BYTES + (SIZE - 1) * region * VALUE_BYTES
        assert t.payload_bytes_received <= (total - mine) * PAIR_BYTES + N * VALUE_BYTES
    elif exchange == "oktopk":
        # The paper's per-rank volume, < 6k(P-1)/P pairs, with k the larger of the target and
        # the largest local count (phase 1 moves the local selections).
        assert t.payload_bytes <= 6 * max(k, int(all_counts.max())) * (SIZE - 1) / SIZE * PAIR_BYTES
    elif exchange == "gtopk":
        # Per tree edge (at most ceil(log2 P) per rank): k pairs merged, k indices broadcast,
        # k values reduced and k values broadcast.
        edges = math.ceil(math.log2(SIZE))
        assert t.payload_bytes <= edges * k * (PAIR_BYTES + 3 * VALUE_BYTES)
    assert t.bytes_sent >= t.payload_bytes_sent and t.bytes_received >= t.payload_bytes_received


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_steps_equal_the_oracle_and_resume_from_state_dict(config, comm, assert_identical_across_ranks):
    name, params = config
    compressor = horovod_sparse.create(name, **params)
    exchange = exchange_of(compressor)
    error_feedback = getattr(compressor, "error_feedback", True)
    momentum = getattr(compressor, "momentum", None)
    k_steady = compressor.k_for(N)
    warmup_steps = getattr(compressor, "warmup_steps", 0)
    kind = "heavy" if name in ("gaussiank", "dgc") else "normal"
    grads = [gradient(N, step, RANK, kind) for step in range(STEPS)]

    sparsifier = compressor.make_pipeline(N, comm)
    outputs, snapshot = [], None
    for step in range(STEPS):
        if step == SNAPSHOT_AFTER:
            snapshot = copy.deepcopy(sparsifier.state_dict())
        residual_before = sparsifier.residual.copy()
        velocity_before = None if momentum is None else sparsifier.velocity.copy()
        acc, velocity = expected_accumulation(grads[step], residual_before, velocity_before, momentum)
        if not error_feedback:
            acc = grads[step]

        k = sparsifier.k_at(step)   # the warm-up's count: N while dense, then its ramp's, then k_steady
        out = sparsifier.step(grads[step], tag=0xABC)
        info = sparsifier.last
        warmup = info.method == "dense"
        assert warmup == (k == N)
        ramps = name == "topk" and exchange in ("allgather", "dsa") and step < 2 * warmup_steps
        ramp_k = max(k_steady, math.ceil(compressor.density ** ((step - warmup_steps + 1) / warmup_steps) * N)) \
            if ramps else k_steady
        assert k == (N if step < warmup_steps or ramp_k * SIZE >= N else ramp_k)

        def local_checks():
            assert out.dtype == np.float32 and out.shape == (N,)
            assert info.step == step and sparsifier.step_count == step + 1
            check_local_selection(compressor, sparsifier, info, acc, k)
            check_conservation(info, acc, sparsifier.residual, error_feedback)
            if momentum is not None:  # momentum factor masking: u cleared where v was
                expected_velocity = velocity.copy()
                expected_velocity[info.cleared_indices] = 0
                assert bitwise_equal(sparsifier.velocity, expected_velocity)

        on_every_rank(local_checks)
        outputs.append(out)

        # The oracle: each rank's kept sparse vector, densified and summed over ranks.
        oracle = rank_ordered_sum(N, info.cleared_indices, info.kept_values)
        by_allreduce = allreduce_sum(N, info.cleared_indices, info.kept_values)
        union = union_of(info.local_indices)
        counts = np.array(comm.allgather(info.local_indices.size))
        selected = info.selected

        def oracle_checks():
            assert np.allclose(oracle, by_allreduce, rtol=1e-12, atol=0)
            if warmup or exchange in ("allgather", "dsa"):
                if exchange == "allgather" and not warmup:
                    # Same summation order as the engine (float64, rank order): bitwise equal.
                    assert bitwise_equal(out, oracle.astype(np.float32))
                    assert np.array_equal(selected, union)
                else:
                    assert np.allclose(out, oracle, rtol=1e-5, atol=1e-6 * SIZE)
                    assert np.all(np.isin(union, selected))
                assert np.all(out[np.setdiff1d(np.arange(N), union)] == 0)
            else:  # oktopk / gtopk: equal on the selected indices, zero elsewhere
                rest = np.setdiff1d(np.arange(N), selected)
                assert np.all(out[rest] == 0)
                assert np.allclose(out[selected], oracle[selected], rtol=1e-5, atol=1e-6 * SIZE)
                assert np.all(np.isin(selected, union))
                if exchange == "gtopk":
                    assert selected.size == min(k, union.size)
                else:
                    assert math.floor(0.8 * min(k, union.size)) <= selected.size \
                        <= math.floor(1.2 * k)
                assert np.array_equal(info.cleared_indices,
                                      np.intersect1d(info.local_indices, selected))
            check_traffic(exchange, info, counts, k, warmup)

        on_every_rank(oracle_checks)
        assert_identical_across_ranks(out)
        assert_identical_across_ranks(selected)
    final_state = sparsifier.state_dict()
    sparsifier.close()

    # A fresh sparsifier loaded from the snapshot replays the remaining steps bitwise.
    resumed = compressor.make_pipeline(N, comm)
    resumed.load_state_dict(snapshot)
    replayed = [resumed.step(grads[step], tag=0xABC) for step in range(SNAPSHOT_AFTER, STEPS)]
    resumed_state = resumed.state_dict()
    resumed.close()

    def resume_checks():
        for step, out in zip(range(SNAPSHOT_AFTER, STEPS), replayed):
            assert bitwise_equal(out, outputs[step]), step
        assert set(resumed_state) == set(final_state)
        for key, value in final_state.items():
            assert isinstance(value, (int, np.ndarray, np.generic)), (key, type(value))
            assert bitwise_equal(np.asarray(resumed_state[key]), np.asarray(value)), key

    on_every_rank(resume_checks)


@pytest.mark.parametrize("name", ["topk", "oktopk", "gtopk", "gaussiank", "threshold", "dgc"])
def test_cumulative_traffic_is_the_sum_of_the_steps(name, comm):
    compressor = horovod_sparse.create(name, **({"value": 1.0} if name == "threshold" else
                                                {"density": 0.05}))
    with compressor.make_pipeline(500, comm) as sparsifier:
        assert sparsifier.last is None
        total = None
        for step in range(3):
            sparsifier.step(gradient(500, step, RANK))
            total = sparsifier.last.traffic if total is None else total + sparsifier.last.traffic
        assert all_ranks(sparsifier.traffic == total)
        assert all_ranks(SIZE == 1 or total.payload_bytes > 0)
