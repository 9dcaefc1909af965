"""randomk through DistributedGradientTape inside tf.function under a loss scaler's overflow.

A gradient that holds inf or NaN on one rank comes out NaN on every rank, and the step leaves no
state changed on any rank (tf.Variables: each gradient commits under a tf.cond on its reduced
payload, and the next step's settle, traced before the gradients' tf.conds, rolls back those
that committed in a step where another overflowed). A run with overflows injected at some steps
(skipped) equals, bit for bit, a run that never saw those steps; a Keras 2 LossScaleOptimizer
under the mixed_float16 policy trains through its overflows.
"""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds


SPEC = "randomk:density=0.1"
BAD_STEPS = (2, 3, 6)  # two in a row; each on rank step % P


def data(rank, n=400):
    rng = np.random.default_rng(500 + rank)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = ((x[:, :4].sum(1) > 0).astype(np.int64) + 2 * (x[:, 4] > 0)).astype(np.int64)
    return x, y


def make_model(last_dtype=None):
    """Layers named, so that the variables (the compressor's keys, and its random streams) have
    the same names in every model built here."""
    tf.keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose: the broadcast must fix it
    return tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(32, activation="relu", name="hidden"),
                                tf.keras.layers.Dense(4, dtype=last_dtype, name="head")])


def flat_weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


def state_copy(compression):
    return {key: {"residual": entry["residual"].copy(), "step": entry["step"]}
            for key, entry in compression.state_dict().items()}


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["step"] == b[key]["step"], f"{key}: step {a[key]['step']} != {b[key]['step']}"
        np.testing.assert_array_equal(a[key]["residual"], b[key]["residual"], err_msg=str(key))


class Trainer:
    """SGD with momentum over DistributedGradientTape; a step is taken only when every reduced
    gradient is finite (the loss scaler's way). An overflow is injected on this rank through the
    loss: ``"every"`` multiplies it by inf (every gradient non-finite), ``"one"`` adds inf times
    the sum of the head's kernel (that gradient only); otherwise by 1.0 and 0.0, in every run."""

    def __init__(self):
        self.model, self.compression = make_model(), hvds.Compression.from_spec(SPEC)
        self.opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
        self.loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.x, self.y = data(hvd.rank())
        self.model(self.x[:1])
        hvd.broadcast_variables(self.model.variables, root_rank=0)

    @tf.function
    def gradients(self, xb, yb, factor, head_factor):
        with tf.GradientTape() as tape:
            loss = self.loss_fn(yb, self.model(xb, training=True)) * factor
            loss += head_factor * tf.reduce_sum(self.model.get_layer("head").kernel)
        tape = hvd.DistributedGradientTape(tape, compression=self.compression)
        return tape.gradient(loss, self.model.trainable_variables)

    @tf.function
    def apply(self, grads):
        self.opt.apply_gradients(zip(grads, self.model.trainable_variables))

    def step(self, i, overflow=None):
        rows = slice(i % 50 * 8, (i % 50 + 1) * 8)
        factors = [tf.constant(np.inf if overflow == kind else value, tf.float32)
                   for kind, value in (("every", 1.0), ("one", 0.0))]
        grads = self.gradients(self.x[rows], self.y[rows], *factors)
        finite = all(np.isfinite(g.numpy()).all() for g in grads)
        if finite:
            self.apply(grads)
        return grads, finite


@pytest.mark.parametrize("overflow", ["every", "one"])
def test_overflowed_steps_change_nothing_and_the_run_equals_one_without_them(overflow, assert_identical_across_ranks):
    run = Trainer()
    names = [v.name for v in run.model.trainable_variables]
    for step in range(9):
        # steps 2 and 3 are settled by the next step's traced settle, step 6 by state_dict()
        before = state_copy(run.compression) if step == 6 else None
        grads, finite = run.step(step, overflow if step in BAD_STEPS and hvd.rank() == step % hvd.size() else None)
        assert finite == (step not in BAD_STEPS)
        if step in BAD_STEPS:  # NaN on every rank, whichever rank overflowed
            for name, grad in zip(names, grads):
                assert np.isnan(grad.numpy()).all() == (overflow == "every" or name == "head/kernel:0"), name
        if before is not None:  # and no state changed
            assert_same_state(state_copy(run.compression), before)
    params = flat_weights(run.model)
    assert_identical_across_ranks(params)

    oracle = Trainer()
    for step in (s for s in range(9) if s not in BAD_STEPS):
        oracle.step(step)
    np.testing.assert_array_equal(params, flat_weights(oracle.model))
    assert_same_state(state_copy(run.compression), state_copy(oracle.compression))
    assert all(entry["step"] == 9 - len(BAD_STEPS) for entry in run.compression.state_dict().values())


@pytest.fixture
def mixed_float16():
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    tf.keras.mixed_precision.set_global_policy("float32")


def test_loss_scale_optimizer_under_mixed_float16_trains_through_its_overflows(mixed_float16,
                                                                               assert_identical_across_ranks):
    """Keras 2's LossScaleOptimizer with an initial scale that overflows float16: it skips the
    first steps on every rank and lowers the scale; training goes on, and every gradient's step
    counter counts exactly the steps taken. The head is float32 (as Keras advises): its
    gradient stays finite where the float16 layer's overflows, and it is rolled back with the
    step (else its residual would keep a gradient 2**13 times too large, and training diverge)."""
    model = make_model(last_dtype="float32")
    compression = hvds.Compression.from_spec(SPEC)
    opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.05, momentum=0.9),
                                                      initial_scale=2.0 ** 30)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data(hvd.rank())
    model(x[:1])
    hvd.broadcast_variables(model.variables, root_rank=0)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
            scaled = opt.get_scaled_loss(loss)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(scaled, model.trainable_variables)
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
        opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), model.trainable_variables))
        return loss, finite

    taken, losses, scales = 0, [], []
    for i in range(60):
        rows = slice(i % 20 * 8, (i % 20 + 1) * 8)
        loss, finite = step(x[rows], y[rows])
        taken += bool(finite)
        losses.append(float(loss))
        scales.append(float(opt.loss_scale))
    params = flat_weights(model)
    assert np.isfinite(params).all()
    assert_identical_across_ranks(params)
    assert_identical_across_ranks(np.array(scales))
    drops = [b < a for a, b in zip([2.0 ** 30] + scales, scales)]
    first_taken = drops.index(False)  # the scale fell at every step before: all skipped
    assert first_taken >= 3, f"the first steps did not overflow: {scales}"
    skipped = sum(drops)
    assert skipped - first_taken <= 3, f"the scale did not settle: {scales}"  # a later overflow now and then
    assert np.mean(losses[-10:]) < np.mean(losses[first_taken:first_taken + 10]), "loss did not decrease"
    assert taken == 60 - skipped
    assert all(entry["step"] == taken for entry in compression.state_dict().values())
