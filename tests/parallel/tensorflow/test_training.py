"""Training with DistributedGradientTape inside tf.function, and with Keras model.fit through
horovod.tensorflow.keras.DistributedOptimizer: replicas must stay bitwise identical."""
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds

SPECS = ["none", "fp16", "randomk:density=0.1"]


def data(rank, n=400):
    rng = np.random.default_rng(500 + rank)
    x = rng.standard_normal((n, 16)).astype(np.float32)
    y = ((x[:, :4].sum(1) > 0).astype(np.int64) + 2 * (x[:, 4] > 0)).astype(np.int64)
    return x, y


def make_model():
    tf.keras.utils.set_random_seed(100 + hvd.rank())  # different on purpose: the broadcast must fix it
    return tf.keras.Sequential([tf.keras.Input((16,)), tf.keras.layers.Dense(32, activation="relu"),
                                tf.keras.layers.Dense(4)])


def flat_weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


@pytest.mark.parametrize("spec", SPECS)
def test_gradient_tape_replicas_bitwise_identical_after_50_steps(spec, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(spec)
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data(hvd.rank())

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    model(x[:1])
    hvd.broadcast_variables(model.variables, root_rank=0)
    start = flat_weights(model)
    losses = [float(step(x[i % 50 * 8:(i % 50 + 1) * 8], y[i % 50 * 8:(i % 50 + 1) * 8])) for i in range(50)]
    params = flat_weights(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start)
    assert np.mean(losses[-10:]) < np.mean(losses[:10])
    assert compression.dense_bytes_per_step == params.size * 4
    if spec.startswith("randomk"):
        assert compression.payload_bytes_per_step < 0.15 * compression.dense_bytes_per_step
        assert all(int(s.step.numpy()) == 50 for s in compression.state.slots.values())


@pytest.mark.parametrize("spec", SPECS)
def test_keras_fit_replicas_bitwise_identical(spec, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(spec)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(hvd.rank(), n=160)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_identical_across_ranks(flat_weights(model))
    assert compression.payload_bytes_per_step > 0, "Horovod never called compress: no allreduce happened"
    assert history.history["loss"][-1] < history.history["loss"][0]
