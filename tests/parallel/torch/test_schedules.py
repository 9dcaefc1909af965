"""Schedules of the out-of-band compressors: buckets exchanged on channel threads
while backward runs, behind the stock hvd.DistributedOptimizer.

Every schedule, for a sparsifier, a quantizer and the dense sum: every step equals an
oracle (a numpy pipeline per planned bucket, fed this rank's local gradients in the plan's
order and summed with mpi4py; before the plan, one pipeline over the whole step, whose
residual the buckets then take over by name), the replicas end bitwise identical, the
dense schedules equal Horovod's own allreduce, a checkpoint resumes bit for bit, and a
rank whose layers differ fails on every rank.
"""
import copy
import sys

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.schedule import PLANNED

from bucket_oracle import BucketOracle  # tests/parallel: shared with TensorFlow's schedules

WIDTH = 40
SCHEDULES = ["wfbp", "mgwfbp", "optimal", "asc", "auto"]
SPECS = ["topk:density=0.05", "qsgd", "dense"]
STEPS = 6
SWITCH_INTERVAL = sys.getswitchinterval()


def five_layers():
    torch.manual_seed(11)
    return nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(WIDTH, WIDTH), nn.ReLU())],
                         nn.Linear(WIDTH, WIDTH))


def scheduled(spec, schedule, **kwargs):
    if schedule == "auto":  # two steps per candidate plan (a warm-up, a timed one): the tests see it settle
        kwargs.setdefault("trial_steps", 1)
    return hvds.Compression.from_spec(spec, schedule=schedule, dense_below=0, profile_steps=1, **kwargs)


def distributed(model, compression):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def loss_of(model, step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
    return torch.nn.functional.mse_loss(model(x), y)


def local_gradients(model, step):
    twin = copy.deepcopy(model)
    loss_of(twin, step).backward()
    return {name: p.grad.numpy().copy() for name, p in twin.named_parameters()}


def train_step(model, opt, step):
    """One step; returns the averaged gradients by name."""
    opt.zero_grad()
    loss_of(model, step).backward()
    opt.synchronize()
    reduced = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    with opt.skip_synchronize():
        opt.step()
    return reduced


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("spec", SPECS)
def test_every_schedule_equals_its_oracle_and_keeps_replicas_identical(spec, schedule, comm,
                                                                       assert_identical_across_ranks):
    model, compression = five_layers(), scheduled(spec, schedule)
    opt = distributed(model, compression)
    oracle = BucketOracle(spec, comm, {name: tuple(p.shape) for name, p in model.named_parameters()})
    start = flat(model).copy()
    try:
        for step in range(STEPS if schedule != "auto" else 2 + 2 * len(PLANNED)):
            grads = local_gradients(model, step)
            oracle.check(train_step(model, opt, step), grads)
            report = compression.schedule_report  # planned at the end of the profiled step 0
            assert report["schedule"] == schedule and report["running"] in PLANNED
            assert sorted(k for keys in report["buckets"] for k in keys) == sorted(oracle.shapes)
            assert set(report["channels"]) <= ({0, 1} if report["running"] == "asc" else {0})
            if schedule == "wfbp":
                assert len(report["buckets"]) == len(oracle.shapes)
            if schedule != "auto":
                assert report["chosen"] == schedule
            if report["buckets"] != oracle.names:  # the plan after profiling, or auto's next candidate
                assert step == 0 or schedule == "auto", "only auto changes its plan after planning"
                oracle.plan(report["buckets"])
        assert report["chosen"] in PLANNED, "auto settles after two steps per candidate and one more"
        timeline = compression.last_step_timeline()   # the last step: every bucket, in order of time
        assert [b["bucket"] for b in timeline["buckets"]] == list(range(len(report["buckets"])))
        assert len(timeline["arrived"]) == len(oracle.shapes) and timeline["arrived"][0] == 0.0
        assert all(0 <= b["ready"] <= b["start"] <= b["end"] for b in timeline["buckets"])
    finally:
        oracle.close()
        compression.close()
    assert_identical_across_ranks(flat(model))
    assert not np.array_equal(flat(model), start)
    assert sys.getswitchinterval() == SWITCH_INTERVAL, "closing the channels gives Python its switch interval back"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", ["after_backward"] + SCHEDULES)
def test_dense_schedules_equal_horovods_own_allreduce(schedule, assert_identical_across_ranks):
    ours, horovods = five_layers(), five_layers()
    compression = scheduled("dense", schedule)
    opt_ours, opt_horovods = distributed(ours, compression), distributed(horovods, hvd.Compression.none)
    for step in range(STEPS):
        reduced = train_step(ours, opt_ours, step)
        expected = train_step(horovods, opt_horovods, step)
        for name in expected:
            np.testing.assert_allclose(reduced[name], expected[name], rtol=1e-5, atol=1e-7, err_msg=name)
    compression.close()
    np.testing.assert_allclose(flat(ours), flat(horovods), rtol=1e-5, atol=1e-6)
    assert_identical_across_ranks(flat(ours))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec, schedule", [("topk:density=0.05", "asc"), ("qsgd", "mgwfbp"),
                                            ("oktopk:density=0.05", "wfbp")])
def test_a_checkpoint_resumes_the_same_buckets_bit_for_bit(spec, schedule, assert_identical_across_ranks):
    """Train 6 steps; save after 3 (model, optimizer, compressor), resume in a new optimizer
    and compressor: the last 3 steps give bitwise the parameters of the uninterrupted run."""
    model, compression = five_layers(), scheduled(spec, schedule)
    opt = distributed(model, compression)
    for step in range(STEPS):
        if step == 3:
            saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
                     copy.deepcopy(compression.state_dict()))
        train_step(model, opt, step)
    compression.close()
    assert saved[2]["(fused)"]["plan"]["keys"], "the plan is saved with the state"

    resumed, again = five_layers(), scheduled(spec, schedule)
    resumed.load_state_dict(saved[0])
    opt = distributed(resumed, again)
    opt.load_state_dict(saved[1])
    again.load_state_dict(saved[2])
    for step in range(3, STEPS):
        train_step(resumed, opt, step)
    assert again.schedule_report is None, "a resumed run takes the saved plan, it does not profile again"
    again.close()
    np.testing.assert_array_equal(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))


def settle(model, opt, compression, step):
    """Train from ``step`` until auto has kept a plan; returns the next step."""
    while compression.schedule_report is None or compression.schedule_report["chosen"] is None:
        train_step(model, opt, step)
        step += 1
    return step


@pytest.mark.timeout(240)
def test_auto_runs_each_candidate_then_keeps_the_fastest_measured(assert_identical_across_ranks):
    model, compression = five_layers(), scheduled("topk:density=0.05", "auto", trial_steps=2)
    opt = distributed(model, compression)
    train_step(model, opt, 0)  # profiled and planned: the candidates run from the next step
    report = compression.schedule_report
    candidates = [t["schedule"] for t in report["trials"]]
    assert len(candidates) >= 2 and len(set(candidates)) == len(candidates)  # one bucket and wfbp differ here
    if hvd.rank() == 0:  # where the plans are made
        assert report["predicted_s"][candidates[0]] == min(report["predicted_s"].values())  # the simulator's pick first
    ran = []
    for step in range(1, 2 + 3 * len(candidates)):  # a warm-up step and 2 timed ones each, and one more
        assert report["chosen"] is None            # step of the last while its last period comes in
        ran.append(report["running"])
        train_step(model, opt, step)
    assert ran == [name for name in candidates for _ in range(3)] + [candidates[-1]]
    measured = {t["schedule"]: t["measured_s"] for t in report["trials"]}
    assert all(len(t["steps_s"]) == 2 and t["measured_s"] == np.median(t["steps_s"]) for t in report["trials"])
    assert all(seconds > 0 for seconds in measured.values())
    assert report["chosen"] == report["running"] == min(measured, key=measured.get)
    assert_identical_across_ranks(np.array([PLANNED.index(report["chosen"])] + list(measured.values())))
    kept = copy.deepcopy(report["buckets"])
    for step in range(step + 1, step + 4):
        train_step(model, opt, step)
        assert report["buckets"] == kept and report["chosen"] == min(measured, key=measured.get)
    compression.close()
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(240)
def test_auto_resumes_its_kept_plan_bit_for_bit_and_tries_again_if_saved_before(assert_identical_across_ranks):
    spec = "topk:density=0.05"
    model, compression = five_layers(), scheduled(spec, "auto")
    opt = distributed(model, compression)
    train_step(model, opt, 0)
    trying = copy.deepcopy(compression.state_dict())
    assert trying["(fused)"]["plan"]["settled"] is False
    step = settle(model, opt, compression, 1)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(compression.state_dict()))
    assert saved[2]["(fused)"]["plan"]["settled"] is True
    for s in range(step, step + 3):
        train_step(model, opt, s)
    compression.close()

    resumed, again = five_layers(), scheduled(spec, "auto")
    resumed.load_state_dict(saved[0])
    opt = distributed(resumed, again)
    opt.load_state_dict(saved[1])
    again.load_state_dict(saved[2])
    for s in range(step, step + 3):
        train_step(resumed, opt, s)
    assert again.schedule_report is None, "a settled plan is resumed as it was"
    again.close()
    np.testing.assert_array_equal(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))

    # saved while trying: the residuals come back, and the run profiles and tries again
    third = scheduled(spec, "auto")
    third.load_state_dict(trying)
    for name, fields in third.state_dict().items():
        if name != "(fused)":
            for field, value in fields.items():
                np.testing.assert_array_equal(value, trying[name][field], err_msg=f"{name} {field}")
    twin = five_layers()
    opt = distributed(twin, third)
    train_step(twin, opt, 1)
    assert third.schedule_report is not None and third.schedule_report["chosen"] is None
    third.close()
    assert_identical_across_ranks(flat(twin))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["wfbp", "asc"])
def test_a_rank_whose_layers_differ_fails_on_every_rank(schedule):
    """After planning, rank 0 alone freezes a layer: its bucket's layout differs, and every
    rank gets the error at the step's first decompress; none waits."""
    model, compression = five_layers(), scheduled("topk:density=0.05", schedule)
    opt = distributed(model, compression)
    train_step(model, opt, 0)
    train_step(model, opt, 1)
    if hvd.rank() == 0:
        model[0].requires_grad_(False)
    with pytest.raises(ValueError, match=r"exchange different gradients"):
        train_step(model, opt, 2)
    compression.close()


@pytest.mark.timeout(120)
def test_a_layer_frozen_after_planning_keeps_its_residual_and_replicas_agree(assert_identical_across_ranks):
    """Freezing a layer on every rank after planning changes its bucket's layout on every
    rank at once: training goes on, the frozen layer does not move, its residual is kept."""
    model, compression = five_layers(), scheduled("topk:density=0.05", "wfbp")
    opt = distributed(model, compression)
    for step in range(2):
        train_step(model, opt, step)
    model[0].requires_grad_(False)
    kept = {f: np.array(v) for f, v in compression.state_dict()["0.weight"].items()}
    frozen = model[0].weight.detach().clone()
    for step in range(2, 5):
        train_step(model, opt, step)
    assert torch.equal(model[0].weight, frozen)
    for field, value in compression.state_dict()["0.weight"].items():
        np.testing.assert_array_equal(value, kept[field], err_msg=field)
    model[0].requires_grad_(True)
    train_step(model, opt, 5)
    assert not torch.equal(model[0].weight, frozen)
    compression.close()
    assert_identical_across_ranks(flat(model))
