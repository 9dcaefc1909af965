"""A loss scaler's overflow in TensorFlow: DistributedGradientTape inside tf.function, a real
``LossScaleOptimizer`` under a ``mixed_float16`` policy (tape and Keras ``fit``): every
out-of-band compressor skips the overflowed step and only that step
(:mod:`horovod_sparse.nonfinite`).

Oracle: the same training without the overflowed steps: the parameters and the compressor's
state must equal it bit for bit.
"""
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.agreement import allgather_int64, communicator_of


SPECS = ["topk:density=0.05", "oktopk:density=0.05", "dgc", "qsgd", "efsignsgd", "powersgd", "fft", "dense"]
STEPS = 7
BAD_STEPS = (2, 4)


def make_model():
    tf.keras.utils.set_random_seed(11)
    # named layers: the compressor's state is keyed by variable name, the same in every run
    return tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="relu", name="fc1"),
                                tf.keras.layers.Dense(32, activation="relu", name="fc2"),
                                tf.keras.layers.Dense(4, name="fc3")])


def batch(step, bad_steps=()):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + 2 * (x[:, 1] > 0)).astype(np.int64)
    if step in bad_steps and hvd.rank() == step % hvd.size():
        x[0, 0] = np.inf
    return x, y


def flat(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


def train(spec, steps, bad_steps=(), bias_only=False):
    """Tape steps, each applied (the way LossScaleOptimizer does) only if every reduced gradient
    is finite; the decision is checked to be the same on every rank. ``bias_only``: the bad
    steps overflow in the last (small) bias's gradient only, which Horovod carries as it is."""
    model, compression = make_model(), hvds.Compression.from_spec(spec)
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def gradients(x, y, poison):
        with tf.GradientTape() as tape:
            # poison * bias: an inf there reaches the bias's gradient alone
            loss = loss_fn(y, model(x, training=True)) + tf.reduce_sum(poison * model.layers[-1].bias)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        return grads, tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads])

    model(np.zeros((1, 32), np.float32))
    hvd.broadcast_variables(model.variables, root_rank=0)
    applied = []
    for step in steps:
        x, y = batch(step, () if bias_only else bad_steps)
        bad_here = bias_only and step in bad_steps and hvd.rank() == step % hvd.size()
        grads, finite = gradients(x, y, tf.constant(np.inf if bad_here else 0.0, tf.float32))
        decisions = allgather_int64(communicator_of(None), [int(finite)])[:, 0]
        assert len(set(decisions.tolist())) == 1, f"ranks disagree on the overflow: {decisions}"
        if bool(finite):
            opt.apply_gradients(zip(grads, model.trainable_variables))
        applied.append(bool(finite))
    return model, compression, applied


def same_state(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", SPECS)
def test_an_overflow_skips_that_step_only(spec, assert_identical_across_ranks):
    model, compression, applied = train(spec, range(STEPS), BAD_STEPS)
    assert applied == [s not in BAD_STEPS for s in range(STEPS)], "a step after the overflow was skipped too"
    oracle, oracle_compression, _ = train(spec, [s for s in range(STEPS) if s not in BAD_STEPS])
    assert np.array_equal(flat(model), flat(oracle)), "the run with overflows differs from the run without them"
    assert same_state(compression.state_dict(), oracle_compression.state_dict())
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "qsgd", "dense"])
def test_an_overflow_in_a_gradient_horovod_carries_skips_the_exchange_too(spec, assert_identical_across_ranks):
    """Only one rank's small bias overflows (Horovod sums it as it is): the compressor's state
    must not move on either, or it would keep gradients at the overflowed loss scale."""
    model, compression, applied = train(spec, range(STEPS), BAD_STEPS, bias_only=True)
    assert applied == [s not in BAD_STEPS for s in range(STEPS)]
    oracle, oracle_compression, _ = train(spec, [s for s in range(STEPS) if s not in BAD_STEPS])
    assert np.array_equal(flat(model), flat(oracle))
    assert same_state(compression.state_dict(), oracle_compression.state_dict())
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(300)
def test_a_planned_schedule_skips_that_step_only(assert_identical_across_ranks):
    """Under a planned schedule the overflowed step is neither profiled nor a plan's step."""
    spec = "topk:density=0.05,schedule=mgwfbp,profile_steps=2"
    model, _, applied = train(spec, range(STEPS), BAD_STEPS)
    assert applied == [s not in BAD_STEPS for s in range(STEPS)]
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "powersgd", "efsignsgd"])
def test_loss_scale_optimizer_with_mixed_float16_trains_on(spec, assert_identical_across_ranks):
    """A real dynamic LossScaleOptimizer whose initial scale overflows the float16 backward: it
    skips a few steps while lowering the scale, then training goes on."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model()
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    compression = hvds.Compression.from_spec(spec)
    opt = tf.keras.mixed_precision.LossScaleOptimizer(tf.keras.optimizers.SGD(0.05), initial_scale=2.0 ** 30,
                                                      dynamic_growth_steps=10)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, tf.cast(model(x, training=True), tf.float32))
            scaled = opt.get_scaled_loss(loss)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    model(np.zeros((1, 32), np.float32))
    hvd.broadcast_variables(model.variables, root_rank=0)
    skipped, losses = 0, []
    for s in range(30):
        before = float(opt.loss_scale)
        losses.append(float(step(*batch(s % 6))))
        skipped += int(float(opt.loss_scale) < before)
    assert np.isfinite(flat(model)).all()
    assert skipped >= 3, f"the initial scale did not overflow (only {skipped} skipped steps)"
    assert skipped <= 20, f"{skipped} of 30 steps skipped: the compressor kept the overflow"
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(300)
def test_keras_fit_under_mixed_float16_trains_on(assert_identical_across_ranks):
    """Keras fit with a mixed_float16 policy and a LossScaleOptimizer around Horovod's Keras
    optimizer, whose initial scale overflows: training goes on with top-k."""
    tf.keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = make_model()
        compression = hvds.Compression.topk(density=0.05)
        opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression)
        opt = tf.keras.mixed_precision.LossScaleOptimizer(opt, initial_scale=2.0 ** 30, dynamic_growth_steps=10)
        model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        x = np.concatenate([batch(s)[0] for s in range(20)])
        y = np.concatenate([batch(s)[1] for s in range(20)])
        history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0,
                            callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    finally:
        tf.keras.mixed_precision.set_global_policy("float32")
    assert float(opt.loss_scale) < 2.0 ** 30, "the initial scale did not overflow"
    assert compression.dense_bytes_per_step > 0, "Horovod never called compress"
    assert np.isfinite(flat(model)).all()
    assert history.history["loss"][-1] < history.history["loss"][0]
    assert_identical_across_ranks(flat(model))
