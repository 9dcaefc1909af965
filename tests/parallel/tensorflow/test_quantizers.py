"""Quantizers, PowerSGD and FFT behind DistributedGradientTape and the Keras optimizer.

As in the PyTorch tests, the oracle is the numpy pipeline (itself checked against
independent oracles in tests/parallel/quantize): the TensorFlow frontend must hand
Horovod exactly what an independent numpy pipeline computes from the same gradients.
TensorFlow exchanges one gradient at a time (one pipeline per gradient) unless grouped.
"""
import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse
import horovod_sparse.tensorflow as hvds
from horovod_sparse.layout import GradientLayout

from test_sparsifiers import data, flat_weights, make_model, train_with_tape

SPECS = ["bf16", "qsgd", "qsgd:method=allgather", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
         "powersgd:rank=2", "fft", "fft:exchange=oktopk"]
OWN_MOMENTUM = ("signum", "signsgd")  # signSGD is plain SGD on signs; Signum has its own momentum
#: learning rates other than 0.05: the sign methods move every coordinate by lr each step (their
#: papers use 1e-3 .. 1e-4), TernGrad's unclipped ternary codes are noisy
LEARNING_RATE = {"signsgd": 0.002, "signum": 0.002, "terngrad": 0.01}
SHAPES = [(64, 40), (40,), (300,)]


@pytest.mark.parametrize("spec", SPECS)
def test_frontend_hands_horovod_what_the_numpy_pipeline_computes(spec, comm, average_across_ranks,
                                                                 assert_identical_across_ranks):
    compressor = hvds.Compression.from_spec(spec, dense_below=64)

    @tf.function
    def exchange(grads):
        return [hvd.allreduce(g, op=hvd.Average, compression=compressor) for g in grads]

    layouts = {i: GradientLayout([(i, s, "float32")]) for i, s in enumerate(SHAPES) if int(np.prod(s)) >= 64}
    references = {i: horovod_sparse.create(spec).make_pipeline(layout.n, comm, layout=layout)
                  for i, layout in layouts.items()}
    try:
        rng = np.random.default_rng(600 + hvd.rank())
        for _ in range(3):
            grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
            results = exchange([tf.constant(g) for g in grads])
            for i, (grad, result) in enumerate(zip(grads, results)):
                if i in layouts:
                    summed = references[i].step(grad.ravel(), tag=layouts[i].tag)
                    want = (summed / np.float32(hvd.size())).reshape(grad.shape)
                else:
                    want = average_across_ranks(grad)
                np.testing.assert_allclose(result.numpy(), want, rtol=1e-6, atol=1e-6)
                assert_identical_across_ranks(result.numpy())
    finally:
        for reference in references.values():
            reference.close()


@pytest.mark.parametrize("spec", SPECS)
def test_gradient_tape_replicas_bitwise_identical_after_100_steps(spec, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(spec, dense_below=100)
    name = spec.split(":")[0]
    opt = tf.keras.optimizers.SGD(LEARNING_RATE.get(name, 0.05), momentum=0.0 if name in OWN_MOMENTUM else 0.9)
    start, losses = train_with_tape(model, compression, opt)
    params = flat_weights(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start)
    assert np.all(np.isfinite(params))
    assert np.mean(losses[-20:]) < np.mean(losses[:20]), f"{spec}: loss did not go down"


@pytest.mark.parametrize("spec", ["qsgd", "powersgd:rank=2", "fft", "topk:density=0.05"])
def test_keras_fit(spec, assert_identical_across_ranks):
    """Keras model.fit through Horovod's Keras DistributedOptimizer: one fused exchange a step,
    identical replicas, and the loss falls."""
    model = make_model()
    compression = hvds.Compression.from_spec(spec, dense_below=100)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(hvd.rank(), n=320)
    history = model.fit(x, y, batch_size=16, epochs=3, shuffle=False, verbose=0,
                        callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_identical_across_ranks(flat_weights(model))
    assert history.history["loss"][-1] < history.history["loss"][0], f"{spec}: the loss did not fall"
    assert len(compression.step_pipelines.layout.entries) == 2, "one exchange of the step's two kernels"
    assert compression.step_pipelines.pipeline.last is not None
