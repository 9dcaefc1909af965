"""``Compression.auto()`` behind hvd.DistributedGradientTape and the Keras DistributedOptimizer,
at P = 2.

Every step equals an oracle that applies the plan of that step per gradient (one exchange per
gradient, as Horovod's tape makes them): fp32's average (float64 here), fp16's (the float16
payloads summed in float32), and per out-of-band choice a numpy pipeline of that gradient fed
this rank's local gradient, with the oracle's own books of what a change of plan does (the
residual goes along into the gradient's next step; the step counter stays with the pipeline).
The choice is the same on every rank, the replicas end bitwise identical, a rank-0
checkpoint resumes bit for bit, and ranks whose settings differ fail together.
"""
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse
import horovod_sparse.tensorflow as hvds
from horovod_sparse import checkpoint
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import cut


DENSE_BELOW = 100  # the kernels (2560, 1600, 160 elements) are the plan's; the biases stay Horovod's
CANDIDATES = ("fp16", "topk:density=0.05", "oktopk:density=0.05")


def auto(**kwargs):
    kwargs = {"candidates": CANDIDATES, "dense_below": DENSE_BELOW, "profile_steps": 2, "trial_steps": 1,
              "prune": 1e9, "max_trials": 4, "check_every": 1000, **kwargs}
    return hvds.Compression.auto(**kwargs)


def make_model():
    tf.keras.utils.set_random_seed(5)
    return tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(40, activation="relu"),
                                tf.keras.layers.Dense(40, activation="relu"), tf.keras.layers.Dense(4)])


def batch(step):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    return rng.standard_normal((8, 64)).astype(np.float32), rng.integers(0, 4, 8)


def trainer(model, compression):
    """(step(x, y) -> averaged gradients by variable name, local(x, y) -> this rank's gradients)."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.05)
    names = [v.name for v in model.trainable_variables]

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return grads

    @tf.function
    def local(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        return tape.gradient(loss, model.trainable_variables)

    model(np.zeros((1, 64), np.float32))
    hvd.broadcast_variables(model.variables, root_rank=0)
    return (lambda x, y: dict(zip(names, [g.numpy() for g in step(x, y)])),
            lambda x, y: dict(zip(names, [g.numpy() for g in local(x, y)])))


def flat(model):
    return np.concatenate([v.numpy().ravel() for v in model.trainable_variables])


class PerGradientOracle:
    """numpy pipelines per (choice, gradient), and the residuals left behind by changes of plan."""

    def __init__(self, comm):
        self.comm = comm
        self.pipelines = {}  # (choice, name) -> (layout, pipeline)
        self.steps = {}      # (choice, name) -> step counter of a pipeline the gradient left
        self.drain = {}
        self.plan = {}

    def check(self, applied, reduced, grads):
        size = self.comm.Get_size()
        for name, grad in grads.items():
            choice = applied.get(name, "horovod")
            old = self.plan.get(name)
            if old not in (None, choice) and (old, name) in self.pipelines:
                layout, reference = self.pipelines.pop((old, name))
                slices, whole = cut(layout, reference.state_dict())
                reference.close()
                self.drain[name] = slices[name].get("memory_residual", slices[name].get("residual")).copy()
                self.steps[(old, name)] = whole["step"]
            self.plan[name] = choice
            g = grad.ravel() + self.drain.pop(name) if name in self.drain and choice != "horovod" else grad.ravel()
            if choice in ("horovod", "none"):
                total = np.empty(g.shape, np.float64)
                self.comm.Allreduce(g.astype(np.float64), total)
                want = total / size
            elif choice == "fp16":
                gathered = np.empty((size, g.size), np.uint16)
                self.comm.Allgather(g.astype(np.float16).view(np.uint16), gathered)
                want = gathered.view(np.float16).astype(np.float32).sum(axis=0) / np.float32(size)
            else:
                if (choice, name) not in self.pipelines:
                    layout = GradientLayout([(name, (g.size,), "float32")])
                    reference = horovod_sparse.create(choice).make_pipeline(layout.n, self.comm, layout=layout)
                    if (choice, name) in self.steps:
                        state = reference.state_dict()
                        state["step"] = self.steps.pop((choice, name))
                        reference.load_state_dict(state)
                    self.pipelines[(choice, name)] = (layout, reference)
                layout, reference = self.pipelines[(choice, name)]
                want = np.asarray(reference.step(g.astype(np.float32), tag=layout.tag)) / np.float32(size)
            np.testing.assert_allclose(reduced[name].ravel(), want, rtol=1e-5, atol=1e-6, err_msg=f"{name} ({choice})")

    def close(self):
        for _, reference in self.pipelines.values():
            reference.close()


@pytest.mark.timeout(300)
def test_every_step_equals_the_per_gradient_oracle_through_trials_and_the_guard(comm, assert_identical_across_ranks,
                                                                                assert_same_text_across_ranks):
    model, compression = make_model(), auto(check_every=2, drift=100.0)
    step, local = trainer(model, compression)
    oracle = PerGradientOracle(comm)
    start, report, plans = flat(model).copy(), compression.auto_report, []
    try:
        def run(s, sleep=0.0):
            x, y = batch(s)
            grads = local(x, y)
            time.sleep(sleep)
            reduced = step(x, y)
            applied = dict(compression.runtime.applied)
            plans.append(applied)
            oracle.check(applied, reduced, grads)

        for s in range(16):
            if s == 12:  # settled by now: a guard bound no residual meets moves them all to fp16
                assert compression.phase == "settled", report
                compression.runtime.max_residual_ratio = 1e-12
            run(s, sleep=0.05 if s >= 12 else 0.0)  # from here on steps of 0.05 s and more: a steady time
        assert report["chosen"] in [t["plan"] for t in report["trials"]]
        assert all(t["measured_s"] > 0 for t in report["trials"])
        assert len({tuple(sorted(p.items())) for p in plans}) >= 2, "the trials ran distinct plans"
        compressed = [k for k, c in plans[11].items() if c not in ("none", "fp16")]
        if compressed:  # the guard moved every compressed kernel to fp16, its residual along
            assert report["guard"] and sorted(report["guard"][0]["keys"]) == sorted(compressed)
            assert all(plans[15][k] == "fp16" for k in compressed)
        # drift: steps ten times slower than the settled ones (0.5 s of sleep in each, not 0.05 s)
        # make it profile and try again, residuals kept (the oracle goes on checking)
        compression.runtime.max_residual_ratio, compression.runtime.drift = 1e9, 2.0
        for s in range(16, 22):
            run(s, sleep=0.05)
        assert not report["replans"]
        for s in range(22, 30):
            run(s, sleep=0.5)
            if report["replans"]:
                break
        assert report["replans"] and report["replans"][-1]["window_s"] > 3 * report["replans"][-1]["baseline_s"]
        assert compression.phase in ("profiling", "trying")
        assert_same_text_across_ranks(sorted(compression.plan.items()))
    finally:
        oracle.close()
        compression.close()
    assert_identical_across_ranks(flat(model))
    assert not np.array_equal(flat(model), start)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("saved_at, phase", [(3, "trying"), (12, "settled")])
def test_a_rank0_checkpoint_resumes_bit_for_bit(saved_at, phase, assert_identical_across_ranks,
                                               assert_resumed_like_uninterrupted, assert_same_state):
    model, compression = make_model(), auto()
    step, _ = trainer(model, compression)
    for s in range(saved_at):
        step(*batch(s))
    weights = [v.numpy().copy() for v in model.variables]
    saved = checkpoint.gather_state(compression)
    mine = compression.state_dict()
    assert compression.phase == phase
    for s in range(saved_at, saved_at + 3):
        step(*batch(s))
    compression.close()
    expected = flat(model)

    for v, w in zip(model.variables, weights):  # the same model (its variables' names are the keys), back
        v.assign(w)
    again = auto()
    checkpoint.scatter_state(again, saved if hvd.rank() == 0 else None)
    assert again.phase == phase
    assert_same_state(again.state_dict(), mine)
    step, _ = trainer(model, again)
    for s in range(saved_at, saved_at + 3):
        step(*batch(s))
    again.close()
    assert_resumed_like_uninterrupted(flat(model), expected)
    assert_identical_across_ranks(flat(model))


def test_ranks_with_other_auto_settings_fail_together():
    model = make_model()
    compression = auto(trial_steps=1 + (hvd.rank() == hvd.size() - 1))
    step, _ = trainer(model, compression)
    with pytest.raises(ValueError, match="auto settings"):
        step(*batch(0))


@pytest.mark.timeout(300)
def test_keras_fit_with_auto_settles_and_keeps_replicas_identical(assert_identical_across_ranks):
    model = make_model()
    compression = auto()
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(hvd.rank())
    x = rng.standard_normal((320, 64)).astype(np.float32)
    y = (x[:, :4].sum(1) > 0).astype(np.int64) + 2 * (x[:, 4] > 0)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert compression.phase == "settled"
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert_identical_across_ranks(flat(model))
    compression.close()


def test_bad_parameters_fail_at_construction():
    for kwargs, name in [({"candidates": ["topk:density=0.001"]}, "min_density"), ({"trial_steps": 0}, "trial_steps"),
                         ({"candidates": ["qsgd"]}, "error feedback")]:
        with pytest.raises(ValueError, match=name):
            hvds.Compression.auto(**kwargs)
    assert isinstance(hvds.Compression.from_spec("auto"), hvds.TFAutoCompressor)


def test_auto_warms_up_on_fp16_before_it_profiles(assert_identical_across_ranks):
    """The warming phase (horovod_sparse.warmup): fp16 for every planned gradient for warmup_steps
    steps, then the first out-of-band candidate while profiling; the count survives a state_dict."""
    model = make_model()
    compression = auto(warmup_steps=2)
    step, _ = trainer(model, compression)
    phases, choices = [], []
    for i in range(5):
        step(*batch(i))
        phases.append(compression.auto_report["phase"])
        choices.append({c for k, c in compression.plan.items() if "kernel" in k})
    # the host call ends a step at the next one's first exchange: the phase shows a step late
    assert phases[:2] == ["warming"] * 2 and choices[0] == {"fp16"}
    assert phases[2] in ("profiling", "trying") and choices[3] != {"fp16"}
    assert compression.state_dict()["auto"]["steps"] >= 4
    assert_identical_across_ranks(flat(model))
