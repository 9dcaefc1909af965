"""Rank-0 checkpoints in TensorFlow (one format for both frontends): the state of
every mechanism, keyed by variable name (one gradient, or a Horovod group as a tuple of
names), goes through ``gather_state`` / ``scatter_state`` and resumes bit for bit.
"""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.checkpoint import gather_state, scatter_state

from test_sparsifiers import data, flat_weights, make_model


STEPS, SAVE_AT = 6, 3


def trainer(model, compression, groups):
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.keras.optimizers.SGD(0.05)  # no slots: the model's weights are the whole optimizer state
    x, y = data(hvd.rank())

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression, groups=groups)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
    return lambda i: step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])


@pytest.mark.parametrize("groups", [None, 1])
@pytest.mark.parametrize("spec", ["randomk:density=0.1", "topk:density=0.05", "qsgd:error_feedback=True",
                                  "powersgd:rank=2",
                                  # saved in the middle of the warm-up's ramp, and at its first compressed step
                                  "topk:density=0.05,warmup_steps=2", "powersgd:rank=2,warmup_steps=3"])
def test_rank0_checkpoint_resumes_bit_for_bit(spec, groups, assert_identical_across_ranks):
    model = make_model()
    model(data(0)[0][:1])
    hvd.broadcast_variables(model.variables, root_rank=0)
    compression = hvds.Compression.from_spec(spec)
    step = trainer(model, compression, groups)
    for i in range(STEPS):
        if i == SAVE_AT:
            weights = [v.numpy().copy() for v in model.variables]
            saved = gather_state(compression)
        step(i)
    expected = flat_weights(model)

    for variable, value in zip(model.variables, weights):  # the same model, back to step SAVE_AT
        variable.assign(value)
    again = hvds.Compression.from_spec(spec)
    scatter_state(again, saved if hvd.rank() == 0 else None)
    step = trainer(model, again, groups)
    for i in range(SAVE_AT, STEPS):
        step(i)
    np.testing.assert_array_equal(flat_weights(model), expected)
    assert_identical_across_ranks(flat_weights(model))
