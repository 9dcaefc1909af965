"""``Compression.auto()`` under a loss scaler's overflow, behind hvd.DistributedGradientTape in
``tf.function``, at P = 2 (and more).

A gradient is made inf or NaN on one rank at chosen steps (the loss gets ``sum(variable *
poison)``, zero but at one element of one variable's on the bad step: that gradient element
becomes the poison, the others are untouched), and each step is applied the way
LossScaleOptimizer applies it (every averaged gradient finite? then ``apply_gradients``, else
the step is skipped). On a bad step every rank's result is not finite (NaN for every gradient
auto exchanged), and a twin run that never sees the bad steps is the oracle: after every good
step both hold the same untimed state of auto's and the same parameters, bit for bit on a
settled plan (through the guard and a change of plan), and no period of a bad step is timed
while trying. ``nonfinite="raise"`` raises on every rank.
"""

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.exchange import NonFiniteGradientError

from test_auto_tf import CANDIDATES, DENSE_BELOW, auto, batch, flat, make_model



def trainer(model, compression):
    """``step(data, bad=None)`` -> this step's averaged gradients by variable index; applied only
    if every one is finite. ``bad``: ``(variable index, value, rank)`` to overflow."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.05)
    variables = model.trainable_variables

    @tf.function
    def reduce(x, y, poison):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            loss = loss + tf.add_n([tf.reduce_sum(v * p) for v, p in zip(variables, poison)])
        return hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)

    @tf.function
    def apply(grads):
        opt.apply_gradients(zip(grads, variables))

    model(np.zeros((1, 64), np.float32))
    hvd.broadcast_variables(model.variables, root_rank=0)

    def step(data, bad=None):
        poison = [np.zeros(v.shape, np.float32) for v in variables]
        if bad is not None and hvd.rank() == bad[2] % hvd.size():
            poison[bad[0]].reshape(-1)[3] = bad[1]
        grads = reduce(*batch(data), poison)
        reduced = [g.numpy() for g in grads]
        if all(np.isfinite(g).all() for g in reduced):
            apply(grads)
        return reduced

    return step


def untimed(compression, model):
    """What of auto's a step may change and no clock decides (the state tree with the trials'
    periods counted, the counters, the profile's steps, the report's moves), the model's
    variables named by position (Keras numbers the layers of a second model on)."""
    runtime = compression.runtime
    state = compression.state_dict()
    trials = state["auto"]["trials"]
    if trials is not None:
        trials["times"] = len(trials["times"])
    return by_position({"state": state, "steps": runtime.steps, "settled_steps": runtime._settled_steps,
                        "profiled": [[k for k, _ in arrivals] for arrivals, _ in runtime.trace.steps],
                        "periods": len(runtime._periods), "phase": runtime.phase,
                        "guard": [(g["step"], g["keys"]) for g in runtime.report["guard"]],
                        "replans": len(runtime.report["replans"])},
                       {v.name: f"variable {i}" for i, v in enumerate(model.trainable_variables)})


def by_position(tree, names):
    """``tree`` with every variable name in it (keys, items, strings) replaced by ``names[name]``."""
    if isinstance(tree, dict):
        return {by_position(k, names): by_position(v, names) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(by_position(x, names) for x in tree)
    if isinstance(tree, str):  # a name, or a layout's description naming them
        for name in sorted(names, key=len, reverse=True):
            tree = tree.replace(name, names[name])
    return tree


def periods_recorded(compression):
    """How many step periods auto holds (the trials', the drift check's). A step's period is
    recorded when the next step's first exchange comes: the step after a bad one records none."""
    trials = compression.runtime._trials
    return (0 if trials is None else len(trials.times)) + len(compression.runtime._periods)


def assert_bad_step_result(reduced, model, compression, bad, assert_identical_across_ranks):
    assert not np.isfinite(reduced[bad[0]]).all(), "the overflow did not reach this rank"
    for v, g in zip(model.trainable_variables, reduced):
        if v.name in compression.runtime.plan:  # exchanged by auto: NaN, whatever its choice
            assert np.isnan(g).all(), f"{v.name} ({compression.plan[v.name]}) is not NaN"
    assert_identical_across_ranks(np.array([np.isfinite(g).all() for g in reduced]))


def settled(model, compression):
    """Settle ``compression`` on a given plan (a checkpoint's: no measurement picks it): the first
    kernel on top-k, the second on fp16, the third on Horovod's fp32 sum, as auto carries them."""
    kernels = [v.name for v in model.trainable_variables if v.shape.num_elements() >= DENSE_BELOW]
    plan = dict(zip(kernels, [CANDIDATES[1], "fp16", "none"]))
    compression.load_state_dict({"auto": {"phase": "settled", "plan": plan, "trials": None, "chosen": "given"},
                                 "candidates": {}, "drain": {}})
    return plan


@pytest.mark.timeout(300)
def test_a_settled_plan_goes_on_as_if_the_bad_steps_never_were(comm, assert_identical_across_ranks,
                                                                 assert_resumed_like_uninterrupted, assert_same_state):
    """Overflows in the top-k kernel, in a bias Horovod carries itself (the step's verdict, read
    before its first exchange, tells the ranks), in the fp16 kernel (an inf, and a float32 value
    past float16's range), and right after the guard moved the top-k kernel to fp16 (its
    residual waiting for its next gradient)."""
    setting_the_guard_at = 5
    bad_after = {1: (0, float("inf"), 0), 2: (1, float("nan"), 1), 3: (2, -float("inf"), 0),
                 4: (2, 1e6, 1),  # finite, but past float16's range: the fp16 kernel's payload overflows
                 5: (4, float("inf"), 1)}
    runs = {}
    for name in ("overflowed", "twin"):
        model, compression = make_model(), auto(check_every=2, drift=1e6)
        plan = settled(model, compression)
        step = trainer(model, compression)
        trace = []
        try:
            for data in range(9):
                if data == setting_the_guard_at:
                    compression.runtime.max_residual_ratio = 1e-12
                step(data)
                trace.append((flat(model), untimed(compression, model)))
                if name == "overflowed" and data in bad_after:
                    bad = bad_after[data]
                    reduced = step(100 + data, bad=bad)
                    assert_bad_step_result(reduced, model, compression, bad, assert_identical_across_ranks)
                    np.testing.assert_array_equal(flat(model), trace[-1][0])  # the step was not applied
            runs[name] = (trace, dict(compression.runtime.report), plan)
        finally:
            compression.close()
        assert_identical_across_ranks(flat(model))
    (trace, report, plan), (twin_trace, twin_report, _) = runs["overflowed"], runs["twin"]
    for (mine, state), (theirs, twin_state) in zip(trace, twin_trace):
        assert_resumed_like_uninterrupted(mine, theirs)
        if comm.size <= 2:  # from P = 3 Horovod's own sums (of the biases) round differently from run to run
            assert_same_state(state, twin_state)
    assert report["skipped_steps"] == len(bad_after) and twin_report["skipped_steps"] == 0
    assert report["guard"] and report["guard"][0]["moved_to"] == "fp16"
    assert report["guard"][0]["keys"] == [k for k, c in plan.items() if c == CANDIDATES[1]]


@pytest.mark.timeout(300)
def test_overflows_while_profiling_and_trying_are_no_steps_of_autos(assert_identical_across_ranks):
    """From scratch: an overflow while profiling and one while trying (within a plan's steps).
    After every good step the twin that never saw them holds the same untimed state, and no
    period of a bad step was timed."""
    profile_steps, runs = 3, {}
    for name in ("overflowed", "twin"):
        model, compression = make_model(), auto(profile_steps=profile_steps)
        step = trainer(model, compression)
        states, bad_steps, recorded = [], 0, None
        try:
            for data in range(2 + profile_steps + 2 * 4 + 2):
                step(data)
                if recorded is not None:  # the bad step's period was not timed
                    assert periods_recorded(compression) == recorded
                    recorded = None
                states.append(untimed(compression, model))
                trials = compression.runtime._trials
                bad = None
                if name == "overflowed" and data == 0:
                    bad = (2, float("inf"), 0)
                elif name == "overflowed" and trials is not None and trials.ran % trials.per_candidate == 0 \
                        and trials.ran > 0 and bad_steps == 1:  # the plan's first step is open: its second is next
                    bad = (3, float("nan"), 1)
                if bad is not None:
                    reduced = step(100 + data, bad=bad)
                    assert not all(np.isfinite(g).all() for g in reduced)
                    assert_identical_across_ranks(np.array([np.isfinite(g).all() for g in reduced]))
                    recorded = periods_recorded(compression) if compression.phase != "profiling" else None
                    bad_steps += 1
            runs[name] = (states, dict(compression.runtime.report), bad_steps, compression.phase)
        finally:
            compression.close()
        assert_identical_across_ranks(flat(model))
    (states, report, bad_steps, phase), (twin_states, twin_report, _, _) = runs["overflowed"], runs["twin"]
    assert bad_steps == 2 and report["skipped_steps"] == 2 and phase == "settled"
    for data, (state, twin_state) in enumerate(zip(states, twin_states)):
        for key in ("steps", "settled_steps", "profiled", "periods", "phase", "replans"):
            assert state[key] == twin_state[key], f"after good step {data}: {key} {state[key]} != {twin_state[key]}"
        trials, twin_trials = state["state"]["auto"]["trials"], twin_state["state"]["auto"]["trials"]
        assert (trials is None) == (twin_trials is None)
        if trials is not None:
            assert (trials["ran"], trials["times"]) == (twin_trials["ran"], twin_trials["times"])


@pytest.mark.timeout(240)
def test_nonfinite_raise_raises_on_every_rank(assert_identical_across_ranks):
    compression = hvds.Compression.from_spec("auto:nonfinite=raise", candidates=CANDIDATES, dense_below=DENSE_BELOW,
                                             check_every=1000)
    assert isinstance(compression, hvds.TFAutoCompressor) and compression.nonfinite == "raise"
    with pytest.raises(ValueError, match="nonfinite"):
        hvds.Compression.auto(nonfinite="ignore")
    model = make_model()
    settled(model, compression)
    step = trainer(model, compression)
    try:
        for data in range(2):
            step(data)
        parameters = flat(model)
        raised = False
        try:
            with pytest.raises((tf.errors.OpError, NonFiniteGradientError), match="inf or NaN"):
                step(100, bad=(0, float("nan"), 1))
            raised = True
        finally:
            assert_identical_across_ranks(np.array([raised]))
        assert compression.auto_report["skipped_steps"] == 1
        np.testing.assert_array_equal(flat(model), parameters)
        step(2)  # and training goes on
    finally:
        compression.close()
    assert_identical_across_ranks(flat(model))
