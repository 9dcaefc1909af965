"""horovod_sparse.schedule's planners (WFBP, MG-WFBP, the exact DP, ASC), the simulator
with simultaneous channels, the cost fits, and the plan as Horovod's ``groups=``."""
import random

import pytest
import torch

from horovod_sparse.schedule import (PLANNED, CostModel, asc_plan, fit_simultaneity, horovod_groups, make_plan,
                                     mgwfbp_plan, optimal_plan, plan_from_groups, ready_times, simulate,
                                     single_plan, wfbp_plan)
from horovod_sparse.schedule.asc import _pair_end
from horovod_sparse.schedule.simulate import slowdown


def step_end(compute_times, sizes, plan, cost, **kw):
    return simulate(ready_times(compute_times), sizes, plan, cost, **kw).step_end


def contiguous_partitions(count):
    for mask in range(1 << (count - 1)):
        plan, start = [], 0
        for i in range(1, count):
            if mask >> (i - 1) & 1:
                plan.append((start, i))
                start = i
        yield plan + [(start, count)]


def random_instance(rng, max_layers=10):
    count = rng.randint(1, max_layers)
    compute = [rng.choice([0.0, rng.uniform(0, 2)]) for _ in range(count)]   # bursts and gaps
    sizes = [rng.randint(1, 100) for _ in range(count)]
    return compute, sizes, CostModel(rng.uniform(0, 2), rng.uniform(0, 0.05))


# ------------------------------------------------------------------ the exact DP
def test_optimal_equals_brute_force_over_all_contiguous_partitions():
    rng = random.Random(10)
    for _ in range(40):
        compute, sizes, cost = random_instance(rng)
        brute = min(step_end(compute, sizes, p, cost) for p in contiguous_partitions(len(sizes)))
        assert step_end(compute, sizes, optimal_plan(compute, sizes, cost), cost) == pytest.approx(brute, rel=1e-12)


def test_optimal_prefers_fewer_buckets_on_ties():
    assert optimal_plan([0.0, 0.0], [1, 1], CostModel(0.0, 1.0)) == [(0, 2)]     # 2 either way


# ------------------------------------------------------------- MG-WFBP's greedy
@pytest.mark.parametrize("compute, sizes, a, b, expected", [
    # start-up dominates: gradient 1 is ready 1 s after 0's exchange starts (1 < a = 2): merge;
    # then 2 is ready 1 s after the merged exchange starts: merge again
    ([1, 1, 1], [1, 1, 1], 2.0, 0.0, [(0, 3)]),
    # backward gaps longer than any exchange: nothing to wait for, nothing merged
    ([1, 5, 5], [1, 1, 1], 1.0, 0.0, [(0, 1), (1, 2), (2, 3)]),
    # 1 is ready 2 s into 0's exchange (3.1 s long): waiting 2 s > a = 0.1 saved, so alone;
    # 1's exchange cannot start before 3.1, after 2 is ready (1.5): merged
    ([0.0, 0.5, 1.0], [3, 1, 1], 0.1, 1.0, [(0, 1), (1, 3)]),
    # the greedy is not optimal: it merges 0 and 1 (waiting 1 s < a = 2), then 1's bucket is
    # 2 s old when 2 is ready (not < a): it ends at 8; the DP's (0)(1, 2) ends at 7
    ([0, 1, 2], [1, 1, 1], 2.0, 1.0, [(0, 2), (2, 3)]),
])
def test_mgwfbp_reproduces_the_reference_merge(compute, sizes, a, b, expected):
    assert mgwfbp_plan(compute, sizes, CostModel(a, b)) == expected


def test_the_greedy_can_lose_to_the_dp():
    cost = CostModel(2.0, 1.0)
    assert step_end([0, 1, 2], [1, 1, 1], mgwfbp_plan([0, 1, 2], [1, 1, 1], cost), cost) == pytest.approx(8.0)
    assert optimal_plan([0, 1, 2], [1, 1, 1], cost) == [(0, 1), (1, 3)]
    assert step_end([0, 1, 2], [1, 1, 1], [(0, 1), (1, 3)], cost) == pytest.approx(7.0)


def test_mgwfbp_is_never_worse_than_one_per_layer_or_one_bucket_and_never_better_than_the_dp():
    rng = random.Random(11)
    for _ in range(300):
        compute, sizes, cost = random_instance(rng)
        greedy = step_end(compute, sizes, mgwfbp_plan(compute, sizes, cost), cost)
        assert greedy <= step_end(compute, sizes, wfbp_plan(len(sizes)), cost) + 1e-9
        assert greedy <= step_end(compute, sizes, single_plan(len(sizes)), cost) + 1e-9
        assert greedy >= step_end(compute, sizes, optimal_plan(compute, sizes, cost), cost) - 1e-9


# ------------------------------------------------------- the simulator, channels
LINE = CostModel(a=0.5, b=0.01)


@pytest.mark.parametrize("k2", [1.0, 1.5, 2.0])
def test_two_buckets_of_m_at_zero_on_two_channels_end_at_a_plus_k2_b_m(k2):
    for plan in ([(0, 1, 0), (1, 2, 1)], [(0, 1), (1, 2)]):          # pinned, or first come first served
        s = simulate([0.0, 0.0], [100, 100], plan, LINE, channels=2, simultaneity=k2)
        assert s.end == [pytest.approx(0.5 + k2 * 0.01 * 100)] * 2
        assert s.channel == [0, 1] and s.start == [0.0, 0.0]


def test_one_bucket_is_a_plus_b_m_whatever_the_channels():
    s = simulate([0.2, 0.3], [100, 200], [(0, 2, 1)], LINE, channels=2, simultaneity=1.5)
    assert s.end == [pytest.approx(0.3 + 0.5 + 0.01 * 300)] and s.channel == [1]


def test_a_flow_that_starts_later_shares_only_the_overlap():
    # A transfers (1 s alone) from 0.5; B starts at 0.5 and transfers from 1.0, when A has
    # 0.5 s left: shared at k2 = 1.5 that takes 0.75 s (A ends at 1.75) and moves half of
    # B, whose other half goes alone (ends at 2.25)
    s = simulate([0.0, 0.5], [100, 100], [(0, 1, 0), (1, 2, 1)], LINE, channels=2, simultaneity=1.5)
    assert s.end == [pytest.approx(1.75), pytest.approx(2.25)]


def test_pinned_buckets_wait_for_their_own_channel():
    s = simulate([0.0, 0.0, 0.0], [100, 100, 100], [(0, 1, 0), (1, 2, 0), (2, 3, 1)], LINE, channels=2,
                 simultaneity=1.0)
    assert s.start == [0.0, pytest.approx(1.5), 0.0] and s.channel == [0, 0, 1]


def test_slowdown_of_n_flows():
    assert slowdown(1, 1.7) == 1.0 and slowdown(2, 1.7) == pytest.approx(1.7)
    assert slowdown(3, 2.0) == pytest.approx(3.0) and slowdown(4, 1.5) == pytest.approx(2.25)
    s = simulate([0.0] * 4, [100] * 4, [(i, i + 1, i) for i in range(4)], CostModel(0.0, 0.01), channels=4,
                 simultaneity=1.5)
    assert s.step_end == pytest.approx(2.25)


def test_the_pair_closed_form_equals_the_simulator():
    rng = random.Random(12)
    for _ in range(200):
        cost = CostModel(rng.uniform(0, 1), rng.uniform(0, 0.02))
        first, second = sorted(rng.uniform(0, 2) for _ in range(2))
        sizes, k2 = [rng.randint(0, 100), rng.randint(0, 100)], rng.uniform(0.8, 2.5)
        sim = simulate([first, second], sizes, [(0, 1, 0), (1, 2, 1)], cost, channels=2, simultaneity=k2)
        assert _pair_end(first, cost(sizes[0]), second, cost(sizes[1]), cost.a, k2) == pytest.approx(sim.step_end)


def test_timeline_rows_carry_the_channels():
    rows = simulate([0.0, 0.0], [100, 100], [(0, 1, 0), (1, 2, 1)], LINE, channels=2, simultaneity=2.0).timeline()
    assert [(r["first"], r["channel"], r["start"]) for r in rows] == [(0, 0, 0.0), (1, 1, 0.0)]
    assert rows[1]["end"] == pytest.approx(2.5) and rows[1]["nbytes"] == 100


def test_simulator_refuses_bad_channels_and_factors():
    with pytest.raises(ValueError, match="channel"):
        simulate([0, 0], [1, 1], [(0, 1, 0), (1, 2, 2)], LINE, channels=2)
    with pytest.raises(ValueError, match="pairs or all"):
        simulate([0, 0], [1, 1], [(0, 1, 0), (1, 2)], LINE, channels=2)
    with pytest.raises(ValueError, match="simultaneity"):
        simulate([0], [1], [(0, 1)], LINE, simultaneity=0.0)


# --------------------------------------------------------------------------- ASC
def test_asc_runs_two_at_once_when_the_link_allows_and_merges_when_it_does_not():
    assert asc_plan([0.0, 0.0], [100, 100], LINE, simultaneity=1.2) == [(0, 1, 0), (1, 2, 1)]
    assert asc_plan([0.0, 0.0], [100, 100], LINE, simultaneity=2.0) == [(0, 2, 0)]
    assert asc_plan([0.0, 0.0], [100, 100], LINE, channels=1, simultaneity=1.0) == [(0, 2, 0)]


def test_asc_is_never_worse_than_the_one_channel_optimum():
    rng = random.Random(13)
    gains = []
    for _ in range(150):
        compute, sizes, cost = random_instance(rng)
        k2 = rng.uniform(1.0, 2.0)
        plan = asc_plan(compute, sizes, cost, simultaneity=k2)
        asc = step_end(compute, sizes, plan, cost, channels=2, simultaneity=k2)
        best = step_end(compute, sizes, optimal_plan(compute, sizes, cost), cost)
        assert asc <= best + 1e-9
        gains.append(best / asc)
    assert max(gains) > 1.2          # and it does use the second channel


def test_asc_refuses_bad_parameters():
    with pytest.raises(ValueError, match="channels must be 1 or 2"):
        asc_plan([0.0], [1], LINE, channels=3)
    with pytest.raises(ValueError, match="simultaneity"):
        asc_plan([0.0], [1], LINE, simultaneity=-1)


# ------------------------------------------------------------- by name, checks
def test_make_plan_by_name():
    compute, sizes = [0.0, 0.5, 1.0], [3, 1, 1]
    cost = CostModel(0.1, 1.0)
    assert make_plan("after_backward", compute, sizes, cost) == [(0, 3)]
    assert make_plan("wfbp", compute, sizes, cost) == [(0, 1), (1, 2), (2, 3)]
    assert make_plan("mgwfbp", compute, sizes, cost) == mgwfbp_plan(compute, sizes, cost)
    assert make_plan("optimal", compute, sizes, cost) == optimal_plan(compute, sizes, cost)
    assert make_plan("asc", compute, sizes, cost, simultaneity=1.5) == asc_plan(compute, sizes, cost,
                                                                                  simultaneity=1.5)
    assert set(PLANNED) == {"after_backward", "wfbp", "mgwfbp", "optimal", "asc"}
    with pytest.raises(ValueError, match="schedule must be one of"):
        make_plan("fastest", compute, sizes, cost)


@pytest.mark.parametrize("planner", [mgwfbp_plan, optimal_plan, asc_plan])
def test_planners_refuse_a_bad_trace(planner):
    with pytest.raises(ValueError, match="one entry per gradient"):
        planner([0.0, 1.0], [1], LINE)
    with pytest.raises(ValueError, match="compute_times must be >= 0"):
        planner([0.0, -1.0], [1, 1], LINE)
    with pytest.raises(ValueError, match="sizes must be >= 0"):
        planner([0.0], [-1], LINE)
    assert planner([], [], LINE) == []


# ------------------------------------------------------------------------- fits
def test_cost_fit_recovers_a_and_b_from_noisy_measurements():
    rng = random.Random(14)
    sizes = [2 ** e for e in range(10, 27, 2) for _ in range(3)]         # geometric, 3 repeats
    times = [2e-4 + 8e-9 * m + rng.gauss(0, 5e-6) for m in sizes]
    fitted, r2 = CostModel.fit(sizes, times)
    assert fitted.a == pytest.approx(2e-4, abs=1e-5) and fitted.b == pytest.approx(8e-9, rel=1e-3)
    assert 0.999 < r2 <= 1.0


def test_simultaneity_fit_recovers_k2():
    rng = random.Random(15)
    sizes = [2 ** e for e in range(16, 27, 2)]
    alone = [1e-3 + 1e-8 * m + rng.gauss(0, 1e-6) for m in sizes]
    together = [1e-3 + 1.6 * 1e-8 * m + rng.gauss(0, 1e-6) for m in sizes]
    k2, r2 = fit_simultaneity(sizes, alone, together)
    assert k2 == pytest.approx(1.6, rel=1e-3) and r2 > 0.999
    with pytest.raises(ValueError, match="grow with size"):
        fit_simultaneity([1, 2], [2.0, 1.0], [1.0, 2.0])


# ----------------------------------------------------------- Horovod's groups=
def test_horovod_groups_round_trip_with_names_and_parameters():
    names = [f"layer{i}" for i in range(5)]
    plan = [(0, 2), (2, 3), (3, 5)]
    groups, env = horovod_groups(plan, names, sizes=[10, 20, 30, 40, 50])
    assert groups == [["layer0", "layer1"], ["layer2"], ["layer3", "layer4"]]
    assert plan_from_groups(groups, names) == plan
    assert env == {"HOROVOD_DISABLE_GROUP_FUSION": "1", "HOROVOD_FUSION_THRESHOLD": str(128 * 1024 * 1024)}

    params = list(reversed(list(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)).parameters())))
    nbytes = [p.numel() * p.element_size() for p in params]
    groups, _ = horovod_groups(asc_plan([0.0] * 4, nbytes, LINE, simultaneity=1.2), params, nbytes)
    assert all(isinstance(p, torch.nn.Parameter) for g in groups for p in g)
    assert plan_from_groups(groups, params) == [(a, b) for a, b, _ in asc_plan([0.0] * 4, nbytes, LINE,
                                                                                  simultaneity=1.2)]


def test_horovod_groups_threshold_holds_the_largest_group():
    _, env = horovod_groups([(0, 2)], ["w", "b"], sizes=[200 * 2 ** 20, 4])
    assert env["HOROVOD_FUSION_THRESHOLD"] == str(200 * 2 ** 20 + 4)


def test_groups_that_are_not_a_plan_are_refused():
    names = ["a", "b", "c"]
    for groups in ([[names[0]], [names[2]], [names[1]]], [[names[0], names[2]], [names[1]]], [[names[0]]],
                   [[names[0], "x"], [names[1], names[2]]]):
        with pytest.raises(ValueError, match="contiguous"):
            plan_from_groups(groups, names)
    with pytest.raises(ValueError, match="one entry per gradient"):
        horovod_groups([(0, 1)], ["a"], sizes=[1, 2])
