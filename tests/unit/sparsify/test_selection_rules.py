"""Local selection rules against brute-force numpy, the documented count bounds, the carried
thresholds, and torch tensors selecting the same entries as numpy arrays."""
import contextlib
import math

import numpy as np
import pytest
import torch

from horovod_sparse.fft.selection import TopCoefficients
from horovod_sparse.ops import cpu
from horovod_sparse.sparsify import count_bounds, k_for, selection
from horovod_sparse.sparsify.device_topk import NO_FLOOR, SOURCES
from horovod_sparse.sparsify.selection import keys_of


def top(acc, k):
    return selection.top_k(keys_of(acc), k).indices


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
    got = top(acc, k)
    assert got.dtype == np.int64 and got.size == min(k, n)
    assert np.array_equal(got, brute_top_k(acc, k))


def test_top_k_breaks_ties_by_lower_index_and_puts_nan_first():
    acc = np.array([1, -2, 2, 0, -0.0, np.nan, 2, np.inf, 1], np.float32)
    assert top(acc, 1).tolist() == [5]
    assert top(acc, 3).tolist() == [1, 5, 7]
    assert top(acc, 5).tolist() == [1, 2, 5, 6, 7]
    assert top(acc, 7).tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert top(acc, 8).tolist() == [0, 1, 2, 3, 5, 6, 7, 8]
    assert top(acc, 100).tolist() == list(range(9))
    assert top(np.empty(0, np.float32), 3).size == 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("value", [1e-3, 0.5, 1.0, 3.0])
def test_threshold_rule_equals_brute_force(kind, value):
    acc = data(kind, 2000, seed=7)
    got, method = selection.ThresholdRule(value).select(acc, keys_of(acc), 0, 0, 0)
    expected = np.flatnonzero((np.abs(acc) >= np.float32(value)) | np.isnan(acc))
    assert method == "threshold" and np.array_equal(got, expected)


def test_threshold_rule_sends_nan_and_inf():
    acc = np.array([0.1, np.nan, -np.inf, 5, 0], np.float32)
    got, _ = selection.ThresholdRule(1.0).select(acc, keys_of(acc), 0, 0, 0)
    assert got.tolist() == [1, 2, 3]


def test_gaussian_threshold_matches_the_formula():
    acc = data("normal", 100_000, seed=1)
    density = 0.01
    z = 2.5758293035489  # |Phi^-1(0.005)|
    # The moments come from every ceil(n / GAUSSIAN_SAMPLE)-th entry, from the first.
    sample = acc[::math.ceil(acc.size / selection.GAUSSIAN_SAMPLE)].astype(np.float64)
    mu, sigma = selection.sample_moments(acc)
    assert (mu, sigma) == pytest.approx((sample.mean(), sample.std()), rel=1e-12, abs=1e-12)
    expected = abs(sample.mean()) + z * sample.std()
    assert selection.gaussian_threshold(mu, sigma, density) == pytest.approx(expected, rel=1e-9)
    # On normal data the first estimate is already close to k.
    count = np.count_nonzero(np.abs(acc) >= selection.gaussian_threshold(mu, sigma, density))
    assert 0.7 * 1000 <= count <= 1.3 * 1000
    assert selection.gaussian_threshold(mu, sigma, 1.0) == pytest.approx(abs(mu))
    assert selection.sample_moments(np.array([np.nan, np.inf], np.float32))[0] != 0  # NaN
    assert selection.gaussian_threshold(*selection.sample_moments(np.array([np.nan, np.inf], np.float32)),
                                        0.1) == math.inf


@pytest.mark.parametrize("kind", ["normal", "ties", "zeros", "denormals", "non-finite", "huge", "odd"])
def test_sample_moments_on_the_device_path_are_the_hosts_bit_for_bit(kind):
    """One read-back of two numbers instead of the sample crossing: the device's sums must be the
    host's bits (the fixed-order tree sum), whatever the data, and close to numpy's own moments."""
    rng = np.random.default_rng(3)
    n = {"odd": 12_347}.get(kind, 50_000)
    acc = rng.standard_normal(n).astype(np.float32)
    if kind == "ties":
        acc = np.round(acc * 4).astype(np.float32) / 4
    elif kind == "zeros":
        acc[rng.random(n) < 0.9] = 0
    elif kind == "denormals":
        acc *= np.float32(1e-41)
    elif kind == "non-finite":
        acc[::7] = np.nan
        acc[::11] = -np.inf
    elif kind == "huge":
        acc *= np.float32(3e37)
    host = selection.sample_moments(acc)
    with cpu.device_path():
        device = selection.sample_moments(torch.from_numpy(acc))
    np.testing.assert_array_equal(np.array(device), np.array(host))
    sample = acc[::math.ceil(n / selection.GAUSSIAN_SAMPLE)].astype(np.float64)
    sample = sample[np.isfinite(sample)]
    assert host == pytest.approx((sample.mean(), sample.std()), rel=1e-12, abs=1e-300)


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
    got, method = selection.GaussianRule(density).select(acc, keys_of(acc), k, 0, 0)
    check_count(got, k, n)
    # Whatever was selected is a threshold set: nothing unselected is larger.
    keys = keys_of(acc)
    unselected = np.setdiff1d(np.arange(n), got)
    if unselected.size and method != "exact":
        assert keys.keys[unselected].max() < keys.keys[got].min()
    if method == "exact":
        assert np.array_equal(got, selection.top_k(keys, k).indices)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("density, sample_fraction", [(0.001, 0.01), (0.01, 0.01), (0.01, 0.001),
                                                      (0.1, 0.05), (0.5, 1.0)])
def test_dgc_count_within_documented_bound(kind, density, sample_fraction):
    n = 20_000
    acc = data(kind, n, seed=3)
    k = k_for(density, n)
    rule = selection.SampledRule(density, sample_fraction)
    for step in range(3):
        got, _ = rule.select(acc, keys_of(acc), k, step, rank=1)
        check_count(got, k, n)


def test_dgc_sample_is_strided_deterministic_per_step_and_rank():
    acc = data("normal", 10_000, seed=5)
    rule = selection.SampledRule(0.01, 0.001)  # 10 keys, every 1000th from a random start
    keys = keys_of(acc)
    samples = {(s, r): rule.sample(keys, s, r) for s in range(3) for r in range(3)}
    for (s, r), sample in samples.items():
        start = int(np.random.default_rng([rule.seed, s, r]).integers(0, 1000))
        assert np.array_equal(sample, keys.keys[start::1000][:10])
        assert np.array_equal(rule.sample(keys, s, r), sample)
    assert len({int(np.flatnonzero(keys.keys == x[0])[0]) for x in samples.values()}) > 1
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
    rule = selection.OkTopkLocalRule(tau_prime)
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


@pytest.mark.parametrize("rule", [selection.TopKRule(), selection.ThresholdRule(1.0), selection.GaussianRule(0.1),
                                  selection.SampledRule(0.1, 0.1), selection.OkTopkLocalRule(4)])
def test_every_rule_handles_empty_buffers(rule):
    empty = np.empty(0, np.float32)
    got, _ = rule.select(empty, keys_of(empty), 0, 0, 0)
    assert got.size == 0 and got.dtype == np.int64


def test_count_bounds():
    assert count_bounds(1) == (1, 2)
    assert count_bounds(2) == (1, 4)
    assert count_bounds(5) == (3, 10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("floor_at", [None, 0.5, 1.0, 1.2, 2.0, 4.0, 100.0])
def test_top_k_from_any_floor_is_the_exact_top_k(kind, floor_at):
    """Whatever floor is carried (too high, in range, too low), the result is exact."""
    n, k = 20_000, 200
    acc = data(kind, n, seed=31)
    keys = keys_of(acc)
    floor = None
    if floor_at is not None:  # a key floor_at times the k-th largest magnitude's
        kth = np.sort(np.abs(acc[np.isfinite(acc)]))[-k] if np.isfinite(acc).sum() >= k else 1.0
        floor = selection.key_of(kth / floor_at)
    found = selection.top_k(keys, k, floor)
    assert np.array_equal(found.indices, brute_top_k(acc, k))
    assert found.source in (("sample", "full") if floor is None else ("floor", "sample", "full"))
    assert found.floor is None or 0 <= found.floor <= 0x7FC00000
    assert_the_device_finds(found, acc, k, floor)


def assert_the_device_finds(found, acc, k, floor):
    """The device's top-k (torch's ops, every branch computed, none read back) gives the host's
    indices, k-th key, next floor and source."""
    with cpu.device_path():
        tensor = torch.from_numpy(acc.copy())
        on_device = selection.top_k(keys_of(tensor), k, floor)
        assert isinstance(on_device.floor, torch.Tensor) and on_device.floor.dim() == 0
        got = (on_device.indices.numpy().tolist(), int(on_device.kth),
               None if int(on_device.floor) == NO_FLOOR else int(on_device.floor), SOURCES[int(on_device.source)])
    assert got == (found.indices.tolist(), int(found.kth), found.floor, found.source)


@pytest.mark.parametrize("n, k, nans", [(200_000, 2000, 0), (20_000, 200, 210), (20_000, 200, 900), (5000, 4999, 0)])
@pytest.mark.parametrize("floor", [None, 0x7FC00000, 0x3F800000, 0])
def test_the_devices_top_k_is_the_hosts(n, k, nans, floor):
    """Strided samples (n > FLOOR_SAMPLE), NaNs among the largest (a NaN floor, none carried
    after it), floors above every key, at 1.0 and at 0."""
    acc = data("student_t2", n, seed=n + nans)
    acc[np.random.default_rng(nans).choice(n, nans, replace=False)] = np.nan
    found = selection.top_k(keys_of(acc), k, floor)
    assert np.array_equal(found.indices, brute_top_k(acc, k))
    assert_the_device_finds(found, acc, k, floor)


def test_top_k_rule_carries_a_floor_and_skips_the_full_partition():
    n, k = 200_000, 2000  # more than FLOOR_SAMPLE: the sampled floor is an estimate
    rule = selection.TopKRule()
    rng = np.random.default_rng(3)
    residual = np.zeros(n, np.float32)
    for step in range(40):
        acc = rng.standard_normal(n).astype(np.float32) + residual
        got, method = rule.select(acc, keys_of(acc), k, step, 0)
        assert method == "exact" and np.array_equal(got, brute_top_k(acc, k))
        residual = acc.copy()
        residual[got] = 0
    # The carried floor fails only in the error-feedback transient; a sampled floor then
    # finds the candidates, and no step partitions the whole buffer.
    assert rule.sampled_floors <= 5 and rule.full_selections == 0, rule.state_dict()
    state = rule.state_dict()
    again = selection.TopKRule()
    again.load_state_dict(state)
    assert again.state_dict() == state
    fresh = selection.TopKRule()
    fresh.load_state_dict({})  # a checkpoint from before the floor existed
    assert fresh.floor is None


def test_gaussiank_carries_its_settled_threshold():
    n, density = 50_000, 0.01
    k = k_for(density, n)
    rule = selection.GaussianRule(density)
    rng = np.random.default_rng(4)
    methods = []
    for step in range(20):
        acc = rng.standard_t(3, n).astype(np.float32) * np.float32(1.01 ** step)
        got, method = rule.select(acc, keys_of(acc), k, step, 0)
        check_count(got, k, n)
        methods.append(method)
        assert rule.threshold is not None and rule.sigma > 0
    # Heavy tails fool the Gaussian formula on the first step; the carried threshold,
    # scaled with the sample's sigma, lands in bounds at once afterwards.
    assert methods[1:].count("estimate") >= 15, methods
    state = rule.state_dict()
    again = selection.GaussianRule(density)
    again.load_state_dict(state)
    assert (again.threshold, again.sigma) == (rule.threshold, rule.sigma)


RULES = [lambda: selection.TopKRule(), lambda: selection.ThresholdRule(1.0),
         lambda: selection.GaussianRule(0.01), lambda: selection.SampledRule(0.01, 0.01),
         lambda: selection.OkTopkLocalRule(4)]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("make_rule", RULES, ids=["topk", "threshold", "gaussiank", "dgc", "oktopk"])
@pytest.mark.parametrize("kind", ["normal", "student_t2", "sparse", "ties"])
def test_torch_tensors_select_what_numpy_arrays_select(make_rule, kind, path):
    """Same rule, same data, over several steps: numpy and torch pick the same indices and
    carry the same state (integer keys make every comparison exact); torch on the host's path
    (numpy's kernels on views) and on the device's (torch's own ops, as on a GPU: top-k's
    branches chosen on the device, its floor read back only by state_dict)."""
    n, k = 30_000, 300
    on_numpy, on_torch = make_rule(), make_rule()
    for step in range(6):
        acc = data(kind, n, seed=100 + step)
        got_numpy, method_numpy = on_numpy.select(acc, keys_of(acc), k, step, 1)
        tensor = torch.from_numpy(acc.copy())
        with cpu.device_path() if path == "device" else contextlib.nullcontext():
            got_torch, method_torch = on_torch.select(tensor, keys_of(tensor), k, step, 1)
        assert isinstance(got_torch, torch.Tensor) and got_torch.dtype == torch.int64
        assert np.array_equal(got_numpy, got_torch.numpy()) and method_numpy == method_torch
        assert repr(on_numpy.state_dict()) == repr(on_torch.state_dict())


@pytest.mark.parametrize("kind", KINDS)
def test_ffts_top_coefficients_on_the_device_are_the_hosts(kind):
    """FFT's exact top-k (its own carried bound on the host; on the device the k-th key and the
    same fixed-size compaction as top-k's) selects the same positions from the same keys."""
    on_host, on_device = TopCoefficients(), TopCoefficients()
    for step, k in enumerate((200, 200, 1, 19_999, 300)):
        keys = keys_of(data(kind, 20_000, seed=7 + step)).keys
        want = on_host.select(keys, k, np.empty(keys.shape[0], np.bool_))
        with cpu.device_path():
            tensor = torch.from_numpy(keys.copy())
            got = on_device.select(tensor, k, torch.empty(tensor.shape[0], dtype=torch.bool))
        assert np.array_equal(want, got.numpy()), (kind, step, k)


def test_top_k_rule_carries_its_floor_across_a_switch_of_path():
    """Steps alternating between the device's path (the floor a 0-d tensor) and the host's (an
    int) select and carry what steps on numpy alone do."""
    rng = np.random.default_rng(0)
    on_numpy, switching = selection.TopKRule(), selection.TopKRule()
    for step in range(6):
        acc = rng.standard_normal(30_000).astype(np.float32)
        want, _ = on_numpy.select(acc, keys_of(acc), 300, step, 0)
        tensor = torch.from_numpy(acc.copy())
        with cpu.device_path() if step % 2 else contextlib.nullcontext():
            got, _ = switching.select(tensor, keys_of(tensor), 300, step, 0)
        assert np.array_equal(want, got.numpy()) and on_numpy.state_dict() == switching.state_dict(), step
