"""``Compression.auto()`` under a loss scaler's overflow, behind the stock hvd.DistributedOptimizer,
at P = 2 and 3.

A gradient is made inf or NaN on one rank at chosen steps (a tensor hook on the parameter, as
an overflowing fp16 backward makes it), and each step is applied the way torch.amp.GradScaler
applies it with Horovod (``opt.synchronize()``; every gradient finite? then ``opt.step()`` under
``skip_synchronize``, else the step is skipped). On a bad step the result is not finite on any
rank (NaN for every out-of-band gradient), and no state of auto's changes. A twin run that never
sees the bad steps is the oracle: the runs are bit for bit the same where no clock decides the
plan (while profiling, and on a settled plan, through the guard and a change of plan); where one
does (the trials), the state no clock decides is the same and no timing record holds a bad
step. A checkpoint right after an overflow resumes bit for bit, and ``nonfinite="raise"`` raises
on every rank.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest

import horovod_sparse.torch as hvds
from horovod_sparse import checkpoint
from horovod_sparse.exchange import NonFiniteGradientError
from horovod_sparse.layout_pipeline import PIPELINE_KEY

from test_auto import CANDIDATES, DENSE_BELOW, auto
from test_schedules import distributed, five_layers, flat, loss_of


def overflow(model, name, value, rank):
    """On ``rank``, make one element of ``name``'s gradient ``value`` in the coming backward (a
    hook on the parameter, before Horovod's); returns the hook's handle, or None elsewhere."""
    if hvd.rank() != rank % hvd.size():
        return None

    def hook(grad):
        grad = grad.clone()
        grad.view(-1)[3] = value
        return grad

    return dict(model.named_parameters())[name].register_hook(hook)


def scaler_step(model, opt, data, bad=None):
    """One step applied as GradScaler applies it: synchronize, then the optimizer's step only if
    every averaged gradient is finite. ``bad``: ``(name, value, rank)`` to overflow. Returns the
    averaged gradients by name."""
    opt.zero_grad()
    handle = overflow(model, *bad) if bad is not None else None
    try:
        loss_of(model, data).backward()
        opt.synchronize()
    finally:
        if handle is not None:
            handle.remove()
    reduced = {name: p.grad.numpy().copy() for name, p in model.named_parameters()}
    if all(np.isfinite(g).all() for g in reduced.values()):
        with opt.skip_synchronize():
            opt.step()
    return reduced


def untimed(compression, periods=True):
    """What of auto's a step may change and no clock decides: the state tree, the counters, the
    profile's steps, the report's moves; and with ``periods``, how many periods the trials and the
    drift check hold (the period of a step is recorded when the next one starts, so a bad step
    records its good predecessor's: left out when comparing a bad step's before and after)."""
    state = copy.deepcopy(compression.state_dict())
    trials = state["auto"]["trials"]
    if trials is not None:
        trials["times"] = len(trials["times"]) if periods else None
    report = compression.auto_report
    return {"state": state, "steps": compression.steps, "settled_steps": compression._settled_steps,
            "profiled": [[k for k, _ in arrivals] for arrivals, _ in compression.trace.steps],
            "arrivals": len(compression.trace._current), "periods": len(compression._periods) if periods else None,
            "phase": compression.phase, "plan": dict(compression.plan),
            "guard": [(g["step"], g["keys"]) for g in report["guard"]], "replans": len(report["replans"])}


def periods_recorded(compression):
    """How many step periods auto holds (the trials', the drift check's). A step's period is
    recorded when the next step starts: the step after a bad one records none."""
    trials = compression._trials
    return (0 if trials is None else len(trials.times)) + len(compression._periods)


def carried(state):
    """``untimed``'s tree with each candidate's state as a change of layout carries it (every
    gradient's slices, a gradient without any being one of zeros, and the step counter): a bad
    step that is the first of a new plan makes the new layout's pipeline from them before its
    check fails, as the next step would have."""
    state = copy.deepcopy(state)
    for spec, tree in state["state"]["candidates"].items():
        whole = tree.pop(PIPELINE_KEY, {})
        for key in [k for k, fields in tree.items() if not any(np.any(v) for v in fields.values())]:
            del tree[key]
        tree[PIPELINE_KEY] = {"step": whole.get("step", 0)}
    return state


def assert_bad_step_result(reduced, compression, bad, assert_identical_across_ranks):
    """The result of an overflowed step on this rank: the bad gradient's sum not finite, every
    out-of-band gradient NaN; and every rank saw the same (which gradients are finite)."""
    name = bad[0]
    assert not np.isfinite(reduced[name]).all(), f"{name}: its overflow did not reach this rank"
    for key, choice in compression.plan.items():
        if choice not in ("none", "fp16"):
            assert np.isnan(reduced[key]).all(), f"{key} ({choice}) is not NaN"
    assert_identical_across_ranks(np.array([np.isfinite(reduced[k]).all() for k in sorted(reduced)]))


def given(plan_of, **kwargs):
    """An auto compressor settled on the plan ``plan_of(name, numel)`` (a checkpoint's, so that no
    measurement picks it), its guard checked every 2 steps and no re-plan on noise."""
    model, compression = five_layers(), auto(check_every=2, drift=1e6, **kwargs)
    plan = {name: plan_of(name, p.numel()) for name, p in model.named_parameters()}
    compression.load_state_dict({"auto": {"phase": "settled", "plan": plan, "trials": None, "chosen": "given"},
                                 "candidates": {}, "drain": {}})
    return model, compression


def mixed(name, numel):
    if numel < DENSE_BELOW:
        return "none"
    return "fp16" if name == "0.weight" else CANDIDATES[1]


@pytest.mark.timeout(240)
def test_a_settled_plan_goes_on_as_if_the_bad_steps_never_were(comm, assert_identical_across_ranks,
                                                                 assert_resumed_like_uninterrupted, assert_same_state):
    """Overflows on a settled plan: a bias (Horovod's allreduce: the buckets learn it from this
    rank's payloads), a top-k weight (its pipeline's own check), a float32 value past float16's
    range in the fp16 weight (its payload is inf), and, right after the guard moved
    every top-k gradient to fp16 (their residuals waiting for their next gradient), a weight of
    a plan with no bucket left (Horovod's sums decide). The twin never sees those steps."""
    setting_the_guard_at = 5  # the guard's check at the 6th good step moves the top-k weights
    bad_after = {1: ("2.bias", float("inf"), 0), 3: ("4.weight", float("nan"), 1),
                 4: ("0.weight", 1e6, 0),  # finite, but past float16's range: its fp16 payload overflows
                 5: ("0.weight", -float("inf"), 1)}
    runs = {}
    for name in ("overflowed", "twin"):
        model, compression = given(mixed)
        opt = distributed(model, compression)
        params, states = [], []
        try:
            for data in range(9):
                if data == setting_the_guard_at:
                    compression.max_residual_ratio = 1e-12
                scaler_step(model, opt, data)
                params.append(flat(model).copy())
                states.append(untimed(compression))
                if name == "overflowed" and data in bad_after:
                    bad = bad_after[data]
                    before = untimed(compression, periods=False)
                    reduced = scaler_step(model, opt, 100 + data, bad=bad)
                    assert_bad_step_result(reduced, compression, bad, assert_identical_across_ranks)
                    assert_same_state(untimed(compression, periods=False), before)
                    np.testing.assert_array_equal(flat(model), params[-1])  # the step was not applied
            runs[name] = (params, states, compression.auto_report)
        finally:
            compression.close()
        assert_identical_across_ranks(flat(model))
    (params, states, report), (twin_params, twin_states, twin_report) = runs["overflowed"], runs["twin"]
    for data, (mine, theirs) in enumerate(zip(params, twin_params)):
        assert_resumed_like_uninterrupted(mine, theirs)
    if comm.size <= 2:  # from P = 3 Horovod's own sums round differently from run to run
        for mine, theirs in zip(states, twin_states):
            assert_same_state(mine, theirs)
    assert report["skipped_steps"] == len(bad_after) and twin_report["skipped_steps"] == 0
    assert [(g["step"], g["keys"]) for g in report["guard"]] == [(g["step"], g["keys"]) for g in twin_report["guard"]]
    assert report["guard"] and report["guard"][0]["moved_to"] == "fp16", "the guard moved the top-k weights"
    assert states[-1]["plan"] == {k: "none" if c == "none" else "fp16" for k, c in states[0]["plan"].items()}


@pytest.mark.timeout(180)
def test_an_overflow_on_the_first_step_of_a_new_plan_changes_nothing(comm, assert_identical_across_ranks,
                                                                     assert_resumed_like_uninterrupted,
                                                                     assert_same_state):
    """A change of plan (top-k to Ok-Topk, as a trial or a re-plan makes it: the residuals drain
    into the weights' next gradients, Ok-Topk's pipeline is made for them) and an overflow on its
    first step: the residuals wait for the next step, which runs as the twin's first step on the
    new plan, bit for bit."""
    runs = {}
    for name in ("overflowed", "twin"):
        model, compression = given(mixed)
        opt = distributed(model, compression)
        params = []
        try:
            for data in range(5):
                if data == 2:
                    compression.adopt({k: CANDIDATES[2] for k, c in compression.plan.items() if c == CANDIDATES[1]})
                    if name == "overflowed":
                        before = carried(untimed(compression, periods=False))
                        bad = ("6.weight", float("inf"), 1)
                        reduced = scaler_step(model, opt, 100, bad=bad)
                        assert_bad_step_result(reduced, compression, bad, assert_identical_across_ranks)
                        assert_same_state(carried(untimed(compression, periods=False)), before)
                        assert compression.drain, "the residuals wait for the next step"
                scaler_step(model, opt, data)
                params.append(flat(model).copy())
            runs[name] = (params, untimed(compression))
        finally:
            compression.close()
        assert_identical_across_ranks(flat(model))
    (params, state), (twin_params, twin_state) = runs["overflowed"], runs["twin"]
    for mine, theirs in zip(params, twin_params):
        assert_resumed_like_uninterrupted(mine, theirs)
    if comm.size <= 2:
        assert_same_state(state, twin_state)


@pytest.mark.timeout(240)
def test_overflows_while_profiling_and_trying_are_no_steps_of_autos(comm, assert_identical_across_ranks,
                                                                    assert_resumed_like_uninterrupted,
                                                                    assert_same_state):
    """From scratch: an overflow while profiling, one while trying (not at a change of plan), one
    settled (the first step of the kept plan, a change of plan when the last plan tried is not
    the one kept). Each changes no state of auto's (a candidate's as a change of layout carries
    it); the twin run goes through the same phases at the
    same good steps, with the same untimed state, the same parameters while profiling (no clock
    decides the plan there), and no period of a bad step among the trials' or settled timings."""
    profile_steps = 3
    runs = {}
    for name in ("overflowed", "twin"):
        model, compression = five_layers(), auto(profile_steps=profile_steps)
        opt = distributed(model, compression)
        trace, bad_steps, recorded = [], 0, None
        try:
            for data in range(2 + profile_steps + 2 * 4 + 3):
                scaler_step(model, opt, data)
                if recorded is not None:  # the bad step's period was not timed
                    assert periods_recorded(compression) == recorded
                    recorded = None
                trace.append((flat(model).copy(), untimed(compression)))
                bad = None
                if name == "overflowed":
                    trials = compression._trials
                    if data == 0:
                        bad = ("2.weight", float("inf"), 0)   # profiling: the profile's candidate gradient
                    elif trials is not None and trials.ran % trials.per_candidate == 1 and bad_steps == 1:
                        bad = ("2.bias", float("nan"), 1)     # trying, within a plan's steps
                    elif compression.phase == "settled" and bad_steps == 2:
                        bad = ("8.weight", -float("inf"), 1)
                if bad is not None:
                    before = carried(untimed(compression, periods=False))
                    reduced = scaler_step(model, opt, 100 + data, bad=bad)
                    assert_bad_step_result(reduced, compression, bad, assert_identical_across_ranks)
                    assert_same_state(carried(untimed(compression, periods=False)), before)
                    recorded = periods_recorded(compression) if compression.phase != "profiling" else None
                    bad_steps += 1
            assert compression.phase == "settled"
            runs[name] = (trace, compression.auto_report, bad_steps)
        finally:
            compression.close()
        assert_identical_across_ranks(flat(model))
    (trace, report, bad_steps), (twin_trace, twin_report, _) = runs["overflowed"], runs["twin"]
    assert bad_steps == 3 and report["skipped_steps"] == 3 and twin_report["skipped_steps"] == 0
    for data, ((mine, state), (theirs, twin_state)) in enumerate(zip(trace, twin_trace)):
        for key in ("steps", "settled_steps", "profiled", "arrivals", "periods", "phase", "replans"):
            assert state[key] == twin_state[key], f"after good step {data}: {key} {state[key]} != {twin_state[key]}"
        trials, twin_trials = state["state"]["auto"]["trials"], twin_state["state"]["auto"]["trials"]
        assert (trials is None) == (twin_trials is None)
        if trials is not None:
            assert (trials["ran"], trials["times"]) == (twin_trials["ran"], twin_trials["times"])
        if data < profile_steps:  # the plans are made from timings at the end of the last profiled step
            assert_resumed_like_uninterrupted(mine, theirs)
        if data < profile_steps - 1:
            assert state["plan"] == twin_state["plan"]
            if comm.size <= 2:
                assert_same_state(state["state"], twin_state["state"])
    assert len(report["trials"]) == len(twin_report["trials"])


@pytest.mark.timeout(180)
def test_a_checkpoint_right_after_an_overflow_resumes_bit_for_bit(assert_identical_across_ranks,
                                                                  assert_resumed_like_uninterrupted, assert_same_state):
    model, compression = given(mixed)
    opt = distributed(model, compression)
    for data in range(3):
        scaler_step(model, opt, data)
    scaler_step(model, opt, 100, bad=("4.weight", float("inf"), 0))
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), checkpoint.gather_state(compression))
    mine = copy.deepcopy(compression.state_dict())
    for data in range(3, 6):
        scaler_step(model, opt, data)
    compression.close()

    resumed, again = five_layers(), auto(check_every=2, drift=1e6)
    resumed.load_state_dict(saved[0])
    opt = distributed(resumed, again)
    opt.load_state_dict(saved[1])
    checkpoint.scatter_state(again, saved[2] if hvd.rank() == 0 else None)
    assert_same_state(again.state_dict(), mine)
    for data in range(3, 6):
        scaler_step(resumed, opt, data)
    again.close()
    assert_resumed_like_uninterrupted(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("plan", ["mixed", "horovod only"])
def test_nonfinite_raise_raises_on_every_rank_and_changes_nothing(plan, assert_identical_across_ranks,
                                                                 assert_same_state):
    """With a bucket the error comes from its header; with none (every gradient fp16 on Horovod's
    allreduce), from Horovod's sums. Either way at the step's last decompress, on every rank."""
    with pytest.raises(ValueError, match="nonfinite"):
        hvds.Compression.auto(nonfinite="ignore")
    spec = f"auto:nonfinite=raise,dense_below={DENSE_BELOW},check_every=2,drift=1000000"
    compression = hvds.Compression.from_spec(spec, candidates=CANDIDATES)
    assert isinstance(compression, hvds.TorchAutoCompressor) and compression.nonfinite == "raise"
    model = five_layers()
    plan_of = mixed if plan == "mixed" else (lambda name, numel: "none" if numel < DENSE_BELOW else "fp16")
    compression.load_state_dict({"auto": {"phase": "settled", "plan": {n: plan_of(n, p.numel()) for n, p in
                                                                       model.named_parameters()},
                                          "trials": None, "chosen": "given"}, "candidates": {}, "drain": {}})
    opt = distributed(model, compression)
    try:
        for data in range(3):
            scaler_step(model, opt, data)
        before, parameters = untimed(compression, periods=False), flat(model).copy()
        raised = False
        try:
            with pytest.raises(NonFiniteGradientError, match="inf or NaN"):
                scaler_step(model, opt, 100, bad=("6.weight", float("nan"), 1))
            raised = True
        finally:
            assert_identical_across_ranks(np.array([raised]))
        assert_same_state(untimed(compression, periods=False), before)
        assert compression.auto_report["skipped_steps"] == 1
    finally:
        compression.close()
    np.testing.assert_array_equal(flat(model), parameters)
    assert_identical_across_ranks(flat(model))
