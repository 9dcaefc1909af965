"""Sparsifiers behind DistributedGradientTape and the Keras DistributedOptimizer: one fused
exchange per step (after_backward), or per gradient / group (wfbp), chained in trace order."""
import time

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvd_keras
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds


SPECS = ["topk:density=0.05", "oktopk:density=0.05", "gtopk:density=0.05", "gaussiank:density=0.05",
         "threshold:value=0.01", "dgc:density=0.05", "topk:density=0.05,exchange=dsa"]


def exact_topk(values, k):
    return np.sort(np.argsort(-np.abs(values), kind="stable")[:k])


@pytest.mark.world_sizes(2, 3)  # the frontend's sums at an odd count too; the rest of the module at 2
def test_topk_first_step_equals_independent_oracle(average_across_ranks):
    compressor = hvds.Compression.topk(density=0.05, dense_below=64)
    shapes = [(64, 40), (40,), (300,)]
    rng = np.random.default_rng(700 + hvd.rank())
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]

    @tf.function
    def exchange(grads):
        return [hvd.allreduce(g, op=hvd.Average, compression=compressor) for g in grads]

    results = exchange([tf.constant(g) for g in grads])
    for grad, result in zip(grads, results):
        if grad.size < 64:
            expected = average_across_ranks(grad)
        else:  # per-gradient top-k in TensorFlow (Horovod exchanges gradients one by one)
            kept = np.zeros(grad.size, np.float32)
            local = exact_topk(grad.ravel(), int(np.ceil(0.05 * grad.size)))
            kept[local] = grad.ravel()[local]
            expected = average_across_ranks(kept).reshape(grad.shape)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-7)


def data(rank, n=800):
    rng = np.random.default_rng(900 + rank)
    x = rng.standard_normal((n, 32)).astype(np.float32)
    y = ((x[:, :4].sum(1) > 0).astype(np.int64) + 2 * (x[:, 4] > 0)).astype(np.int64)
    return x, y


def make_model():
    tf.keras.utils.set_random_seed(100 + hvd.rank())
    return tf.keras.Sequential([tf.keras.Input((32,)), tf.keras.layers.Dense(64, activation="relu"),
                                tf.keras.layers.Dense(4)])


def flat_weights(model):
    return np.concatenate([w.numpy().ravel() for w in model.trainable_variables])


def train_with_tape(model, compression, opt, steps=100):
    """``steps`` DistributedGradientTape steps inside a tf.function on this rank's data
    (batches of 8), starting from rank 0's weights; returns (start weights, losses)."""
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
    return start, [float(step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8])) for i in range(steps)]


@pytest.mark.parametrize("spec", SPECS)
def test_gradient_tape_replicas_bitwise_identical_after_100_steps(spec, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(spec, dense_below=100)
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.0 if spec.startswith("dgc") else 0.9)
    start, losses = train_with_tape(model, compression, opt)
    params = flat_weights(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start)
    assert np.mean(losses[-20:]) < np.mean(losses[:20])
    assert compression.step_pipelines.layout.n == 32 * 64 + 64 * 4, "one exchange of the step's two kernels"


def test_keras_fit_with_oktopk(assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.oktopk(density=0.05, dense_below=100)
    opt = hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.05), compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(hvd.rank(), n=320)
    model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0,
              callbacks=[hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)])
    assert_identical_across_ranks(flat_weights(model))
    assert len(compression.step_pipelines.layout.entries) == 2, "one exchange of the step's two kernels"
    assert compression.step_pipelines.pipeline.last is not None


def test_adasum_is_refused():
    compressor = hvds.Compression.topk(density=0.1)

    @tf.function
    def exchange(g):
        return hvd.allreduce(g, op=hvd.Adasum, compression=compressor)

    with pytest.raises(ValueError, match="Adasum"):
        exchange(tf.ones([2048]))


@pytest.mark.parametrize("schedule", ["after_backward", "wfbp"])
def test_grouped_tape_fuses_the_group_into_one_exchange(schedule, assert_identical_across_ranks, average_across_ranks):
    """One fused top-k of the step's gradients: after_backward fuses the step whatever the grouping;
    wfbp fuses what Horovod hands over at once, here one group (groups=1)."""
    compressor = hvds.Compression.topk(density=0.05, dense_below=64, schedule=schedule)
    variables = [tf.Variable(tf.zeros(s)) for s in [(64, 40), (40,), (300,)]]
    rng = np.random.default_rng(800 + hvd.rank())
    targets = [rng.standard_normal(v.shape).astype(np.float32) for v in variables]

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
        tape = hvd.DistributedGradientTape(tape, compression=compressor, groups=1)
        return tape.gradient(loss, variables)

    results = grads()
    if schedule == "wfbp":
        (keys, (layout, _)), = compressor.pipelines.items()
    else:
        layout = compressor.step_pipelines.layout
    assert layout.n == 64 * 40 + 300, "the two large gradients share one buffer"
    fused = np.concatenate([targets[0].ravel(), targets[2].ravel()])
    kept = np.zeros_like(fused)
    local = exact_topk(fused, int(np.ceil(0.05 * fused.size)))
    kept[local] = fused[local]
    oracle = average_across_ranks(kept)
    np.testing.assert_allclose(results[0].numpy().ravel(), oracle[:2560], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results[2].numpy().ravel(), oracle[2560:], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(results[1].numpy(), average_across_ranks(targets[1]), rtol=1e-6)
    assert_identical_across_ranks(results[0].numpy())


@pytest.mark.parametrize("spec", SPECS + ["topk:density=0.05,exchange=oktopk", "topk:density=0.05,exchange=gtopk"])
def test_reduced_result_matches_what_ranks_kept(spec, average_across_ranks, assert_identical_across_ranks):
    """Over several steps: result == average over ranks of each rank's kept values on the global
    selection, zero elsewhere; and the residual holds exactly what was not consumed."""
    compressor = hvds.Compression.from_spec(spec, dense_below=64)

    @tf.function
    def exchange(grad):
        return hvd.allreduce(grad, op=hvd.Average, compression=compressor)

    rng = np.random.default_rng(950 + hvd.rank())
    residual = np.zeros(2560, np.float32)
    for step in range(4):
        grad = rng.standard_normal((64, 40)).astype(np.float32)
        result = exchange(tf.constant(grad)).numpy().ravel()
        (_, (layout, sparsifier)), = compressor.pipelines.items()
        info = sparsifier.last
        assert_identical_across_ranks(result)
        if spec.startswith("dgc"):
            continue  # DGC's residual is its velocity sum, checked in tests/parallel/sparsify
        acc = grad.ravel() + residual
        kept = np.zeros_like(acc)
        kept[info.local_indices] = acc[info.local_indices]
        np.testing.assert_array_equal(info.sent_values, acc[info.local_indices])
        oracle = average_across_ranks(kept)
        np.testing.assert_allclose(result[info.selected], oracle[info.selected], rtol=1e-5, atol=1e-6)
        assert not np.any(np.delete(result, info.selected))
        residual = sparsifier.residual.copy()


def test_a_step_with_other_gradients_on_one_rank_fails_on_every_rank():
    """Rank 1 traces a step whose variable has another shape: the fused step's layouts differ,
    and every rank fails at the step's layout agreement instead of waiting in a collective."""
    compressor = hvds.Compression.topk(density=0.1, dense_below=0)
    variable = tf.Variable(tf.zeros((20, 10) if hvd.rank() != 1 else (10, 20)))

    @tf.function
    def grads():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(variable * variable)
        return hvd.DistributedGradientTape(tape, compression=compressor).gradient(loss, [variable])

    started = time.monotonic()
    with pytest.raises(Exception, match="exchange different gradients: rank\\(s\\) \\[1\\] differ from rank 0"):
        grads()
    assert time.monotonic() - started < 60


def test_different_shapes_across_ranks_fail_on_every_rank():
    compressor = hvds.Compression.topk(density=0.1, dense_below=0)
    shape = (20, 10) if hvd.rank() != 1 else (10, 20)

    @tf.function
    def exchange(grad):
        return hvd.allreduce(grad, op=hvd.Average, compression=compressor)

    with pytest.raises(Exception, match="rank"):
        exchange(tf.ones(shape))
