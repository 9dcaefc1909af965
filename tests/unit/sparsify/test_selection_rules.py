"""Local selection rules against brute-force numpy, and the documented count bounds."""
import math

import numpy as np
import pytest

from horovod_sparse.sparsify import count_bounds, k_for, rules, selection
from horovod_sparse.sparsify.selection import keys_of


def brute_top_k(acc, k):
    """k largest |acc|, ties to the lower index, NaN largest: a stable sort on -|acc|."""
    magnitude = np.abs(acc.astype(np.float64))
    magnitude[np.isnan(magnitude)] = np.inf * 2  # still inf; order NaN after +inf below
    rank_key = np.where(np.isnan(acc), 2.0, np.where(np.isinf(acc), 1.0, 0.0))
    order = np.lexsort((np.arange(acc.size), -np.where(np.isfinite(acc), magnitude, 0), -rank_key))
    return np.sort(order[:k])


def data(kind, n, seed):
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal(n).astype(np.float32)
    if kind == "shifted":
        return (3 + 0.1 * rng.standard_normal(n)).astype(np.float32)
    if kind == "student_t2":  # heavy tails, finite mean
        return rng.standard_t(2, n).astype(np.float32)
    if kind == "cauchy":  # no mean, no variance
        return rng.standard_cauchy(n).astype(np.float32)
    if kind == "lognormal":
        return (rng.lognormal(0, 2, n) * rng.choice([-1, 1], n)).astype(np.float32)
    if kind == "sparse":  # mostly exact zeros
        out = np.zeros(n, np.float32)
        out[rng.choice(n, n // 50, replace=False)] = rng.standard_normal(n // 50)
        return out
    if kind == "ties":
        return rng.integers(-3, 4, n).astype(np.float32)
    raise ValueError(kind)


KINDS = ["normal", "shifted", "student_t2", "cauchy", "lognormal", "sparse", "ties"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", [(1, 1), (10, 3), (1000, 1), (1000, 10), (5000, 250), (300, 300),
                                  (50, 49)])
def test_top_k_equals_brute_force(kind, n, k):
    acc = data(kind, n, seed=n + k)
    got = selection.top_k(keys_of(acc), k)
    assert got.dtype == np.int64 and got.size == min(k, n)
    assert np.array_equal(got, brute_top_k(acc, k))


def test_top_k_breaks_ties_by_lower_index_and_puts_nan_first():
    acc = np.array([1, -2, 2, 0, -0.0, np.nan, 2, np.inf, 1], np.float32)
    assert selection.top_k(keys_of(acc), 1).tolist() == [5]
    assert selection.top_k(keys_of(acc), 3).tolist() == [1, 5, 7]
    assert selection.top_k(keys_of(acc), 5).tolist() == [1, 2, 5, 6, 7]
    assert selection.top_k(keys_of(acc), 7).tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert selection.top_k(keys_of(acc), 8).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert selection.top_k(keys_of(acc), 100).tolist() == list(range(9))
    assert selection.top_k(keys_of(np.empty(0, np.float32)), 3).size == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [1e-3, 0.5, 1.0, 3.0])
def test_threshold_rule_equals_brute_force(kind, value):
    acc = data(kind, 2000, seed=7)
    got, method = rules.ThresholdRule(value).select(acc, keys_of(acc), 0, 0, 0)
    expected = np.flatnonzero((np.abs(acc) >= np.float32(value)) | np.isnan(acc))
    assert method == "threshold" and np.array_equal(got, expected)


def test_threshold_rule_sends_nan_and_inf():
    acc = np.array([0.1, np.nan, -np.inf, 5, 0], np.float32)
    got, _ = rules.ThresholdRule(1.0).select(acc, keys_of(acc), 0, 0, 0)
    assert got.tolist() == [1, 2, 3]


def test_gaussian_threshold_matches_the_formula():
    acc = data("normal", 100_000, seed=1)
    density = 0.01
    z = 2.5758293035489  # |Phi^-1(0.005)|
    expected = abs(acc.astype(np.float64).mean()) + z * acc.astype(np.float64).std()
    assert selection.gaussian_threshold(acc, density) == pytest.approx(expected, rel=1e-9)
    # On normal data the first estimate is already close to k.
    count = np.count_nonzero(np.abs(acc) >= selection.gaussian_threshold(acc, density))
    assert 0.8 * 1000 <= count <= 1.2 * 1000
    assert selection.gaussian_threshold(acc, 1.0) == pytest.approx(abs(acc.astype(np.float64).mean()))
    assert selection.gaussian_threshold(np.array([np.nan, np.inf], np.float32), 0.1) == math.inf


def check_count(indices, k, n):
    lower, upper = count_bounds(min(k, n))
    assert indices.dtype == np.int64
    assert np.all(np.diff(indices) > 0) and (indices.size == 0 or 0 <= indices[0] <= indices[-1] < n)
    assert lower <= indices.size <= upper, (indices.size, lower, upper)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density", [0.001, 0.01, 0.1, 0.5, 1.0])
def test_gaussiank_count_within_documented_bound(kind, density):
    n = 20_000
    acc = data(kind, n, seed=int(density * 1000))
    k = k_for(density, n)
    got, method = rules.GaussianRule(density).select(acc, keys_of(acc), k, 0, 0)
    check_count(got, k, n)
    # Whatever was selected is a threshold set: nothing unselected is larger.
    keys = keys_of(acc)
    unselected = np.setdiff1d(np.arange(n), got)
    if unselected.size and method != "exact":
        assert keys[unselected].max() < keys[got].min()
    if method == "exact":
        assert np.array_equal(got, selection.top_k(keys, k))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density, sample_fraction", [(0.001, 0.01), (0.01, 0.01), (0.01, 0.001),
                                                      (0.1, 0.05), (0.5, 1.0)])
def test_dgc_count_within_documented_bound(kind, density, sample_fraction):
    n = 20_000
    acc = data(kind, n, seed=3)
    k = k_for(density, n)
    rule = rules.SampledRule(density, sample_fraction)
    for step in range(3):
        got, _ = rule.select(acc, keys_of(acc), k, step, rank=1)
        check_count(got, k, n)


def test_dgc_sample_is_deterministic_per_step_and_rank():
    acc = data("normal", 10_000, seed=5)
    rule = rules.SampledRule(0.01, 0.001)
    keys = keys_of(acc)
    rng = lambda step, rank: np.random.default_rng([rule.seed, step, rank])  # noqa: E731
    estimates = {(s, r): selection.sampled_threshold(keys, 0.01, 10, rng(s, r))
                 for s in range(2) for r in range(2)}
    again = {(s, r): selection.sampled_threshold(keys, 0.01, 10, rng(s, r))
             for s in range(2) for r in range(2)}
    assert estimates == again
    assert len(set(estimates.values())) > 1  # steps and ranks draw different samples
    first, _ = rule.select(acc, keys, 100, 4, 0)
    second, _ = rule.select(acc, keys, 100, 4, 0)
    assert np.array_equal(first, second)


@pytest.mark.parametrize("estimate", [0.0, 1e-30, 1e30, math.inf, math.nan, -1.0])
def test_settle_threshold_survives_any_estimate(estimate):
    acc = data("normal", 5000, seed=2)
    got, threshold, method = selection.settle_threshold(keys_of(acc), estimate, 50)
    check_count(got, 50, 5000)
    assert method in ("estimate", "corrected", "exact")


def test_settle_threshold_on_all_zeros_falls_back_to_exact_top_k():
    acc = np.zeros(1000, np.float32)
    got, _, method = selection.settle_threshold(keys_of(acc), 0.0, 10)
    assert method == "exact" and got.tolist() == list(range(10))
    got, _, method = selection.settle_threshold(keys_of(acc), 1.0, 10)
    assert method == "exact" and got.tolist() == list(range(10))


def test_settle_threshold_with_many_nans_stays_in_bounds():
    acc = data("normal", 1000, seed=4)
    acc[::2] = np.nan  # 500 NaNs, k = 10: exact fallback sends the 10 first NaNs
    got, _, method = selection.settle_threshold(keys_of(acc), 1.0, 10)
    assert method == "exact" and got.tolist() == list(range(0, 20, 2))


@pytest.mark.parametrize("kind", ["normal", "student_t2", "lognormal"])
def test_oktopk_local_threshold_stays_near_k_over_100_drifting_steps(kind):
    n, k, tau_prime = 10_000, 100, 32
    rule = rules.OkTopkLocalRule(tau_prime)
    rng = np.random.default_rng(11)
    residual = np.zeros(n, np.float32)
    counts, methods = [], []
    for step in range(100):
        # The scale drifts up by 0.5% per step and the data change every step;
        # the residual (error feedback) makes |acc| grow where nothing is sent.
        grad = data(kind, n, seed=1000 + step) * np.float32(1.005 ** step)
        acc = grad + residual
        got, method = rule.select(acc, keys_of(acc), k, step, 0)
        check_count(got, k, n)
        counts.append(got.size)
        methods.append(method)
        residual = acc.copy()
        residual[got] = 0
        if method == "exact":
            assert got.size == k
            assert rule.threshold == pytest.approx(np.sort(np.abs(acc))[-k], rel=1e-6)
    counts = np.array(counts)
    assert methods[0] == "exact" and methods[32] == "exact" and methods[64] == "exact"
    assert methods.count("threshold") >= 50  # mostly the cheap nudged threshold
    # The x1.012 nudge lags the residual's growth a little: the mean stays within 30% of k.
    assert abs(counts.mean() - k) <= 0.3 * k, counts.mean()


def test_oktopk_local_threshold_nudges_toward_k():
    keys = keys_of(np.arange(1, 1001, dtype=np.float32))  # magnitudes 1..1000
    local = selection.LocalThreshold(tau_prime=1000, nudge=1.5)
    got, method = local.select(keys, 100, 0)
    assert method == "exact" and got.size == 100 and local.threshold == 901.0
    local.threshold = 850.0  # selects 151 > k: raised
    got, method = local.select(keys, 100, 1)
    assert method == "threshold" and got.size == 151 and local.threshold == 850.0 * 1.5
    local.threshold = 940.0  # selects 61 < k: lowered
    got, method = local.select(keys, 100, 2)
    assert method == "threshold" and got.size == 61 and local.threshold == 940.0 / 1.5
    local.threshold = 990.0  # selects 11 < ceil(k/2): exact at once
    got, method = local.select(keys, 100, 3)
    assert method == "exact" and got.size == 100
    state = local.state_dict()
    other = selection.LocalThreshold(1000)
    other.load_state_dict(state)
    assert other.threshold == local.threshold and other.exact_steps == 2


def test_oktopk_local_threshold_of_zeros_is_recomputed():
    local = selection.LocalThreshold(tau_prime=10)
    keys = keys_of(np.zeros(100, np.float32))
    for step in range(3):
        got, method = local.select(keys, 5, step)
        assert method == "exact" and got.tolist() == [0, 1, 2, 3, 4]
    assert local.threshold is None


@pytest.mark.parametrize("rule", [rules.TopKRule(), rules.ThresholdRule(1.0), rules.GaussianRule(0.1),
                                  rules.SampledRule(0.1, 0.1), rules.OkTopkLocalRule(4)])
def test_every_rule_handles_empty_buffers(rule):
    empty = np.empty(0, np.float32)
    got, _ = rule.select(empty, keys_of(empty), 0, 0, 0)
    assert got.size == 0 and got.dtype == np.int64


def test_count_bounds():
    assert count_bounds(1) == (1, 2)
    assert count_bounds(2) == (1, 4)
    assert count_bounds(5) == (3, 10)
