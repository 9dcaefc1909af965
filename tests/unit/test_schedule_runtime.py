"""The pieces of the scheduled exchanges that run without MPI ranks: the plan's wire form,
the arrival trace, the probe sizes, the choice of ``auto`` and the constructors' checks.
(The exchanges themselves: tests/parallel/torch/test_schedules.py.)"""
import numpy as np
import pytest

import horovod_sparse
from horovod_sparse.schedule import PLANNED, CostModel, choose_plan, ready_times, simulate
from horovod_sparse.step.channels import BucketPlan
from horovod_sparse.step.profiling import FIRST_PROBE_BYTES, ArrivalTrace, probe_prefixes
from horovod_sparse.step.trials import PlanTrials, candidates


def test_a_plan_survives_its_int64_wire_form():
    known = sorted(["fc2.weight", "fc1.weight", "fc1.bias", "out.weight"])
    plan = BucketPlan.from_ranges([(0, 1, 0), (1, 3, 1), (3, 4, 0)],
                                  ["out.weight", "fc2.weight", "fc1.bias", "fc1.weight"])
    assert plan.keys == (("out.weight",), ("fc2.weight", "fc1.bias"), ("fc1.weight",))
    assert plan.channels == (0, 1, 0) and plan.channel_count == 2
    words = plan.encode(known)
    assert words.dtype == np.int64 and words[0] == 3
    assert BucketPlan.decode(words, known) == plan


def test_positions_are_keys_too_and_pairs_go_to_channel_zero():
    plan = BucketPlan.from_ranges([(0, 2), (2, 3)], [2, 0, 1])
    assert plan == BucketPlan(((2, 0), (1,)), (0, 0))
    assert BucketPlan.decode(plan.encode([0, 1, 2]), [0, 1, 2]) == plan


def test_the_trace_is_the_median_of_the_profiled_steps_after_the_first():
    trace = ArrivalTrace()
    # (arrivals, first decompress): the first step is warm-up and left out
    trace.steps = [([("b", 0.0), ("a", 9.0)], 20.0),
                   ([("b", 0.0), ("a", 1.0), ("dense", 1.5)], 1.5),
                   ([("b", 10.0), ("a", 13.0)], 13.5),
                   ([("b", 20.0), ("a", 22.0)], 22.25)]
    order, compute, tail = trace.backward_trace(["a", "b"])
    assert order == ["b", "a"]
    assert compute == [0.0, 2.0]        # median of 1, 3, 2
    assert tail == pytest.approx(0.5)   # median of 0.5, 0.5, 0.25


def test_probes_grow_geometrically_to_the_whole_step():
    sizes = [FIRST_PROBE_BYTES // 2] * 64        # 2 MiB in all
    ends = probe_prefixes(sizes)
    assert ends[-1] == 64 and ends == sorted(set(ends))
    totals = [sum(sizes[:e]) for e in ends]
    assert totals[0] >= FIRST_PROBE_BYTES and all(b >= 3 * a for a, b in zip(totals, totals[1:-1]))
    assert probe_prefixes([10]) == [1]


def test_auto_keeps_the_plan_with_the_earliest_simulated_end():
    compute, sizes, line = [0.0, 0.01, 0.01, 0.01], [4e6] * 4, CostModel(a=1e-3, b=1e-9)
    choice = choose_plan("auto", compute, sizes, line, simultaneity=1.5)
    assert set(choice.predicted) == set(PLANNED)
    assert choice.predicted[choice.schedule] == min(choice.predicted.values())
    ready = ready_times(compute)
    channels = 2 if choice.schedule == "asc" else 1
    assert simulate(ready, sizes, choice.plan, line, channels=channels,
                    simultaneity=1.5).step_end == pytest.approx(choice.predicted[choice.schedule])
    # start-ups dominate: everything in one bucket, and the simplest schedule wins the tie
    assert choose_plan("auto", compute, [1] * 4, CostModel(a=1.0, b=0.0)).schedule == "after_backward"
    assert choose_plan("wfbp", compute, sizes, line).plan == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError, match="schedule must be one of"):
        choose_plan("fastest", compute, sizes, line)


def test_schedule_is_a_parameter_of_the_out_of_band_compressors_only():
    import horovod_sparse.torch as hvds
    assert hvds.Compression.topk(density=0.01, schedule="asc").schedule == "asc"
    assert hvds.Compression.from_spec("oktopk:density=0.01,schedule=auto").schedule == "auto"
    assert hvds.Compression.dense(schedule="mgwfbp").schedule == "mgwfbp"
    assert hvds.Compression.qsgd().schedule == "after_backward"
    with pytest.raises(ValueError, match=r"schedule must be one of \['after_backward', 'wfbp', 'mgwfbp', "
                                         r"'optimal', 'asc', 'auto'\], got 'fast'"):
        hvds.Compression.topk(schedule="fast")
    with pytest.raises(ValueError, match="profile_steps"):
        hvds.Compression.topk(schedule="wfbp", profile_steps=0)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="trial_steps"):
            hvds.Compression.topk(schedule="auto", trial_steps=bad)
    with pytest.raises(ValueError, match="fp16 has no parameter 'schedule'"):
        hvds.Compression.fp16(schedule="wfbp")


def test_the_tensorflow_frontend_takes_every_schedule_and_checks_it_as_pytorch_does():
    import horovod_sparse.tensorflow as hvds_tf
    assert hvds_tf.Compression.topk(density=0.01).schedule == "after_backward"
    assert hvds_tf.Compression.topk(density=0.01).planned is None
    assert hvds_tf.Compression.topk(density=0.01, schedule="wfbp").planned is None  # per Horovod call
    for planned in ("mgwfbp", "optimal", "asc", "auto"):
        compression = hvds_tf.Compression.topk(density=0.01, schedule=planned, profile_steps=2)
        assert compression.schedule == planned and compression.planned.exchanges.profile_steps == 2
    with pytest.raises(ValueError, match=r"schedule must be one of \['after_backward', 'wfbp', 'mgwfbp', "
                                         r"'optimal', 'asc', 'auto'\], got 'fast'"):
        hvds_tf.Compression.topk(schedule="fast")
    with pytest.raises(ValueError, match="profile_steps"):
        hvds_tf.Compression.topk(schedule="mgwfbp", profile_steps=0)
    with pytest.raises(ValueError, match="trial_steps"):
        hvds_tf.Compression.topk(schedule="auto", trial_steps=1.5)


def test_dense_is_the_plain_float32_sum_on_one_rank():
    from mpi4py import MPI
    grad = np.random.default_rng(0).standard_normal(1000).astype(np.float32)
    with horovod_sparse.create("dense").make_pipeline(grad.size, MPI.COMM_SELF) as pipeline:
        np.testing.assert_array_equal(np.asarray(pipeline.step(grad)), grad)
        np.testing.assert_array_equal(np.asarray(pipeline.step(2 * grad)), 2 * grad)   # no residual


def test_probe_buffers_grow_geometrically_to_the_whole_step():
    from horovod_sparse.step.profiling import PROBE_FACTOR, probe_lengths
    lengths = probe_lengths(10_000_000)
    assert lengths[0] == FIRST_PROBE_BYTES // 4 and lengths[-1] == 10_000_000
    assert all(b == PROBE_FACTOR * a for a, b in zip(lengths, lengths[1:-1]))
    assert probe_lengths(100) == [100]


def test_auto_tries_each_distinct_plan_once_the_simulators_pick_first():
    compute, sizes, line = [0.0, 0.01, 0.01, 0.01], [4e6] * 4, CostModel(a=1e-3, b=1e-9)
    choice = choose_plan("auto", compute, sizes, line, simultaneity=1.5)
    order = ["d", "c", "b", "a"]
    tried = candidates(choice, order)
    names = [name for name, _ in tried]
    assert names[0] == choice.schedule and set(names) <= set(PLANNED)
    assert [choice.predicted[n] for n in names] == sorted(choice.predicted[n] for n in names)
    plans = [plan for _, plan in tried]
    assert len(set(plans)) == len(plans), "a plan is tried once"
    every = {BucketPlan.from_ranges(ranges, order) for ranges in choice.plans.values()}
    assert set(plans) == every, "every distinct plan is tried"
    assert all(plan.keys[0][0] == "d" for plan in plans), "over the keys in backward order"


def test_trials_keep_the_fastest_median_of_the_slowest_rank():
    from mpi4py import MPI
    trials = PlanTrials([("wfbp", "plan a"), ("mgwfbp", "plan b"), ("optimal", "plan c")], steps=3)
    # per candidate: a warm-up step (not counted), then 3 timed ones; the last runs on untimed
    switches = [trials.step_ran() for _ in range(12)]
    assert switches == [False, False, False, True] * 2 + [False] * 4 and trials.index == 2
    for seconds in (0.01, 0.30, 0.10, 0.12,   0.01, 0.11, 0.50, 0.09,   9.0, 0.20, 0.20):
        trials.record(seconds)
        assert not trials.finished
    trials.record(0.20)   # the last step's period, as the next step begins
    assert trials.finished
    trials.record(5.0)    # one more: not counted
    best, timed = trials.decide(MPI.COMM_SELF)
    assert timed == [[0.30, 0.10, 0.12], [0.11, 0.50, 0.09], [0.20, 0.20, 0.20]]
    assert best == 1   # the smallest median (0.12, 0.11, 0.20), not mean (0.173, 0.233, 0.20)
    tie = PlanTrials([("wfbp", 1), ("mgwfbp", 2)], steps=1)
    for seconds in (0.5, 0.1, 0.2, 0.1):
        tie.step_ran(), tie.record(seconds)
    assert tie.decide(MPI.COMM_SELF)[0] == 0, "ties go to the earlier candidate"
    with pytest.raises(ValueError, match="candidate"):
        PlanTrials([], steps=1)

