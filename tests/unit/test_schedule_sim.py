"""horovod_sparse.schedule: cost models, bucket plans, and the event-driven simulator's
closed forms."""
import math

import pytest

from horovod_sparse.schedule import (CostModel, RingAllreduce, TableCost, layer_plan, netai_plan, ready_times,
                                     simulate, simulate_cycles, single_plan, threshold_plan)

LINE = CostModel(a=0.5, b=0.01)


# ------------------------------------------------------------------------ costs
def test_cost_model_is_a_line():
    assert LINE(0) == 0.5
    assert LINE(100) == pytest.approx(1.5)


def test_fit_recovers_an_exact_line_with_r2_one():
    sizes = [1e3, 1e4, 1e5, 1e6]
    fitted, r2 = CostModel.fit(sizes, [LINE(s) for s in sizes])
    assert fitted.a == pytest.approx(0.5) and fitted.b == pytest.approx(0.01)
    assert r2 == pytest.approx(1.0)


def test_fit_of_noisy_points_has_r2_below_one():
    fitted, r2 = CostModel.fit([1, 2, 3, 4], [1.0, 2.5, 2.5, 4.0])
    assert 0 < r2 < 1
    assert fitted.b == pytest.approx(0.9)


def test_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="two distinct sizes"):
        CostModel.fit([5, 5], [1.0, 1.1])


def test_ring_allreduce_formula_and_its_line():
    ring = RingAllreduce(bandwidth_bps=8e9, latency_s=1e-5, workers=4)
    m = 1e6
    assert ring(m) == pytest.approx(6 * 1e-5 + 2 * m * 3 / 4 / 1e9)
    line = ring.linear()
    assert line(m) == pytest.approx(ring(m))


def test_ring_on_one_worker_costs_nothing():
    assert RingAllreduce(1e9, 1e-3, workers=1)(1e9) == 0.0


def test_ring_ratio_divides_the_wire_not_the_reduction():
    add = CostModel(0.0, 1e-9)
    plain = RingAllreduce(8e9, 0.0, 2, reduce=add)
    halved = RingAllreduce(8e9, 0.0, 2, ratio=2.0, reduce=add)
    m = 1e6
    assert plain(m) - halved(m) == pytest.approx(m / 1e9 / 2)
    assert halved(m) == pytest.approx(m / 1e9 / 2 + add(m / 2))


def test_table_cost_interpolates_and_clamps():
    table = TableCost((10, 0), (2.0, 1.0))    # given unsorted
    assert table(5) == pytest.approx(1.5)
    assert table(-1) == 1.0 and table(100) == 2.0


# ------------------------------------------------------------------------ plans
def test_static_plans():
    assert layer_plan(3) == [(0, 1), (1, 2), (2, 3)]
    assert single_plan(3) == [(0, 3)]
    assert single_plan(0) == []


def test_netai_plan_flushes_at_5ms_or_64MiB():
    assert netai_plan([0.002, 0.002, 0.002, 0.001], [1, 1, 1, 1]) == [(0, 3), (3, 4)]
    big = 64 * 1024 * 1024
    assert netai_plan([0.0, 0.0, 0.0], [big - 1, 1, 5]) == [(0, 2), (2, 3)]
    assert netai_plan([0.005], [4]) == [(0, 1)]


def test_threshold_plan_puts_an_oversized_gradient_alone():
    assert threshold_plan([4, 4, 10, 1, 1], 8) == [(0, 2), (2, 3), (3, 5)]


# -------------------------------------------------------------------- simulator
def test_one_bucket_ends_at_ready_plus_a_plus_bM():
    s = simulate(ready=[0.1, 0.3, 0.7], sizes=[10, 20, 30], plan=single_plan(3), cost=LINE)
    assert s.end == [pytest.approx(0.7 + 0.5 + 0.01 * 60)]
    assert s.step_end == pytest.approx(1.8) and s.overhead == pytest.approx(1.1)


def test_two_buckets_ready_at_zero_on_one_channel():
    s = simulate(ready=[0.0, 0.0], sizes=[100, 300], plan=layer_plan(2), cost=LINE)
    assert s.step_end == pytest.approx(2 * 0.5 + 0.01 * (100 + 300))
    assert s.start == [0.0, pytest.approx(1.5)]


def test_two_channels_run_two_buckets_at_once():
    s = simulate(ready=[0.0, 0.0], sizes=[100, 300], plan=layer_plan(2), cost=LINE, channels=2)
    assert s.end == [pytest.approx(1.5), pytest.approx(3.5)]
    assert s.channel == [0, 1]


def test_fifo_a_late_bucket_waits_for_the_channel_and_an_idle_one_for_its_gradient():
    s = simulate(ready=[0.0, 0.2, 5.0], sizes=[100, 100, 100], plan=layer_plan(3), cost=LINE)
    assert s.start == [0.0, pytest.approx(1.5), pytest.approx(5.0)]
    assert s.end[-1] == pytest.approx(6.5)


def test_overhead_is_zero_when_communication_hides_behind_backward():
    s = simulate(ready=[0.0, 10.0], sizes=[1, 1], plan=layer_plan(2), cost=CostModel(0.0, 0.0))
    assert s.overhead == 0.0
    s = simulate(ready=[0.0], sizes=[1], plan=[(0, 1)], cost=LINE, backward_end=100.0)
    assert s.overhead == 0.0 and s.busy == pytest.approx(0.51)


def test_bad_plans_are_refused():
    for plan in ([(0, 1)], [(0, 2), (1, 3)], [(1, 3)], [(0, 0), (0, 3)]):
        with pytest.raises(ValueError, match="contiguous"):
            simulate([0, 0, 0], [1, 1, 1], plan, LINE)
    with pytest.raises(ValueError, match="channels"):
        simulate([0], [1], [(0, 1)], LINE, channels=0)


def test_ready_times_are_cumulative():
    assert ready_times([0.5, 0.25, 0.25]) == [0.5, 0.75, 1.0]


def test_cycles_fuse_what_is_ready_at_each_tick():
    s = simulate_cycles(ready=[0.0, 0.0, 2.5], sizes=[1, 1, 1], cost=CostModel(1.0, 0.0), cycle_s=1.0,
                        threshold_bytes=10)
    assert s.plan == [(0, 2), (2, 3)]
    assert s.start == [0.0, 3.0] and s.end == [1.0, 4.0]


def test_cycles_wait_for_the_previous_collectives():
    # the 2nd gradient is ready at 0.1 but the loop is busy until 5; it then goes alone
    s = simulate_cycles([0.0, 0.1, 0.2], [1, 1, 1], CostModel(5.0, 0.0), cycle_s=0.001, threshold_bytes=10)
    assert s.plan == [(0, 1), (1, 3)]
    assert s.start[1] == pytest.approx(5.0) and s.step_end == pytest.approx(10.0)


def test_cycles_split_at_the_fusion_threshold():
    s = simulate_cycles([0.0] * 4, [6, 6, 6, 6], CostModel(1.0, 0.0), cycle_s=0.001, threshold_bytes=12)
    assert s.plan == [(0, 2), (2, 4)] and s.step_end == pytest.approx(2.0)


def test_cycles_with_zero_cycle_time_start_as_soon_as_ready():
    s = simulate_cycles([0.3, 0.7], [1, 1], CostModel(0.1, 0.0), cycle_s=0.0, threshold_bytes=1)
    assert s.start == [pytest.approx(0.3), pytest.approx(0.7)]


def test_cycle_ticks_are_multiples_of_the_cycle():
    s = simulate_cycles([0.00251], [1], CostModel(0.0, 0.0), cycle_s=0.001, threshold_bytes=1)
    assert s.start[0] == pytest.approx(0.003)
    assert math.isclose(s.step_end, 0.003)
