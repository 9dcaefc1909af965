"""TensorFlow under ``horovodrun --gloo -np 3`` (scripts/run_tests.py; the tests take any count):
the TensorFlow frontend's exchanges (host calls inside the traced step, ``tf.numpy_function``)
run over ``horovod.tensorflow``'s own collectives, eagerly, beside the step's pending allreduces
(:class:`~horovod_sparse.horovod_collectives.HorovodCollectives`). A ``tf.function`` step through
``DistributedGradientTape`` and Keras ``fit`` through Horovod's ``DistributedOptimizer`` train with
bitwise-identical replicas; ``dense`` equals Horovod's own ``none``, bit for bit at P = 2 (a + b
either way, halved exactly), within float32 rounding at P > 2; planned schedules are refused on
every rank (no hang).

Its own launch (scripts/run_tests.py launches each module of the group apart): Horovod runs one
frontend per process, and the PyTorch module initialises ``horovod.torch``.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # before TensorFlow is imported

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvd_keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod_sparse.tensorflow as hvds  # noqa: E402

STEPS = 6
TRAINED = ["dense", "topk:density=0.05", "gtopk:density=0.05", "oktopk:density=0.05", "qsgd", "int4", "auto"]


def make_model():
    tf.keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose: the broadcast must fix it
    return tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(8)])  # 2048 weights go out of band


def data(n):
    rng = np.random.default_rng(100 + hvd.rank())
    return rng.standard_normal((n, 32)).astype(np.float32), rng.standard_normal((n, 8)).astype(np.float32)


def flat_weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


def train_tape(spec, steps=STEPS, **params):
    """``steps`` ``tf.function`` steps through ``DistributedGradientTape``; the flat parameters."""
    compression = hvds.Compression.from_spec(spec, **params)
    model, opt = make_model(), tf.keras.optimizers.SGD(0.05, momentum=0.9)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    hvd.broadcast_variables(model.variables, root_rank=0)
    x, y = data(16 * steps)
    try:
        for i in range(steps):
            step(x[16 * i:16 * (i + 1)], y[16 * i:16 * (i + 1)])
        return flat_weights(model)
    finally:
        getattr(compression, "close", lambda: None)()


def every_rank(flat, name):
    """Every rank's ``flat`` (1-D), row r from rank r: Horovod's allgather, not ours."""
    return hvd.allgather(tf.constant(flat[None]), name=f"tests.gloo.tf.{name}").numpy()


def assert_same_on_every_rank(flat, name):
    rows = every_rank(flat, name)
    assert all(np.array_equal(row.view(np.uint32), rows[0].view(np.uint32)) for row in rows)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", TRAINED)
def test_gradient_tape_gives_every_rank_the_same_parameters(spec):
    flat = train_tape(spec)
    assert np.isfinite(flat).all()
    assert_same_on_every_rank(flat, f"tape.{spec}")
    assert not np.array_equal(flat, every_rank(flat_weights(make_model()), f"start.{spec}")[0]), \
        "no step changed the parameters"


@pytest.mark.timeout(90)
def test_dense_equals_horovods_own_allreduce():
    ours, horovods = train_tape("dense", dense_below=0), train_tape("none")
    if hvd.size() == 2:
        np.testing.assert_array_equal(ours, horovods)
    else:
        np.testing.assert_allclose(ours, horovods, rtol=1e-5, atol=1e-6 * np.abs(horovods).max())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "int4"])
def test_keras_fit_gives_every_rank_the_same_parameters(spec):
    model = make_model()
    compression = hvds.Compression.from_spec(spec)
    model.compile(optimizer=hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression),
                  loss="mse")
    x, y = data(96)
    try:
        history = model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
                            callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    finally:
        compression.close()
    assert_same_on_every_rank(flat_weights(model), f"fit.{spec}")
    assert compression.dense_bytes_per_step > 0, "Horovod never called compress"
    assert history.history["loss"][-1] < history.history["loss"][0]


@pytest.mark.world_sizes(3)  # a refusal: the same at any size
@pytest.mark.timeout(90)
@pytest.mark.parametrize("spec, params, refusal", [
    ("topk:density=0.05", {"schedule": "mgwfbp"}, r"schedule='mgwfbp' exchanges on helper threads")])
def test_what_the_transport_cannot_carry_is_refused_on_every_rank(spec, params, refusal):
    with pytest.raises(Exception, match=refusal):  # a ValueError, or TensorFlow's carrying its message
        train_tape(spec, steps=1, **params)
    hvd.join()  # the ranks go on together: none waits in an exchange
