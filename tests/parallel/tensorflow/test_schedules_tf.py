"""Planned schedules in TensorFlow: the traced step hands each gradient to the
schedule's runtime, which profiles, plans and exchanges the planned buckets on channel
threads, as in PyTorch (tests/parallel/torch/test_schedules.py).

Every planned schedule, for a sparsifier, a quantizer and the dense sum, through
``DistributedGradientTape`` in a ``tf.function``: every step equals the bucket oracle (numpy
pipelines per planned bucket, before the plan one over the whole step, whose residual the
buckets then take over by name), the replicas end bitwise identical; the TensorFlow ops path
(``on_device``) gives the numpy path's bits; a checkpoint resumes the plan bit for bit; a TF1
graph runs it too.
"""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.schedule import PLANNED

from bucket_oracle import BucketOracle  # tests/parallel: shared with PyTorch's schedules

WIDTH = 40
LAYERS = 5
SCHEDULES = ["mgwfbp", "optimal", "asc", "auto"]
SPECS = ["topk:density=0.05", "qsgd", "dense"]
STEPS = 6


def scheduled(spec, schedule, **kwargs):
    if schedule == "auto":  # two steps per candidate plan (a warm-up, a timed one): the tests see it settle
        kwargs.setdefault("trial_steps", 1)
    return hvds.Compression.from_spec(spec, schedule=schedule, dense_below=0, profile_steps=1, **kwargs)


def make_variables():
    init = np.random.default_rng(5)  # the same start on every rank
    return [tf.Variable(init.standard_normal((WIDTH, WIDTH)).astype(np.float32) * 0.2, name=f"w{i}")
            for i in range(LAYERS)]


def batch(step):
    rng = np.random.default_rng(1000 * hvd.rank() + step)
    return rng.standard_normal((8, WIDTH)).astype(np.float32)


def loss_of(variables, x):
    h = x
    for w in variables:
        h = tf.tanh(tf.matmul(h, w))
    return tf.reduce_sum(h * h)


def train_step(variables, compression):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = loss_of(variables, x)
        grads = hvd.DistributedGradientTape(tape, compression=compression).gradient(loss, variables)
        for w, g in zip(variables, grads):
            w.assign_sub(0.05 * g)
        return grads
    return step


def local_gradients(variables, x):
    with tf.GradientTape() as tape:
        loss = loss_of(variables, tf.constant(x))
    return {w.name: g.numpy() for w, g in zip(variables, tape.gradient(loss, variables))}


def flat(variables):
    return np.concatenate([w.numpy().ravel() for w in variables])


def run_steps(variables, compression, steps, oracle=None, check_report=None):
    step = train_step(variables, compression)
    for i in steps:
        x = batch(i)
        grads = local_gradients(variables, x)
        reduced = {w.name: g.numpy() for w, g in zip(variables, step(tf.constant(x)))}
        if oracle is not None:
            oracle.check(reduced, grads)
            report = compression.schedule_report  # planned at the end of the profiled step 0
            if check_report is not None:
                check_report(i, report)
            if report["buckets"] != oracle.names:
                oracle.plan(report["buckets"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("spec", SPECS)
def test_every_planned_schedule_equals_its_oracle_and_keeps_replicas_identical(spec, schedule, comm,
                                                                               assert_identical_across_ranks):
    variables, compression = make_variables(), scheduled(spec, schedule)
    oracle = BucketOracle(spec, comm, {w.name: tuple(w.shape) for w in variables})
    start = flat(variables)

    def check_report(i, report):
        assert report["schedule"] == schedule and report["running"] in PLANNED
        assert sorted(k for keys in report["buckets"] for k in keys) == sorted(oracle.shapes)
        assert set(report["channels"]) <= ({0, 1} if report["running"] == "asc" else {0})
        if schedule != "auto":
            assert report["chosen"] == schedule
        if report["buckets"] != oracle.names:
            assert i == 0 or schedule == "auto", "only auto changes its plan after planning"

    try:
        run_steps(variables, compression, range(STEPS if schedule != "auto" else 2 + 2 * len(PLANNED)),
                  oracle, check_report)
        assert compression.schedule_report["chosen"] in PLANNED
        timeline = compression.last_step_timeline()  # the arrival calls reached the runtime, one per gradient
        assert len(timeline["arrived"]) == LAYERS and timeline["arrived"][0] == 0.0
        assert all(0 <= b["ready"] <= b["start"] <= b["end"] for b in timeline["buckets"])
    finally:
        oracle.close()
        compression.close()
    assert_identical_across_ranks(flat(variables))
    assert not np.array_equal(flat(variables), start)


@pytest.mark.timeout(240)
def test_tensorflow_ops_give_the_numpy_paths_bits_under_a_plan(assert_identical_across_ranks):
    """The plan comes from measured times, so both runs take the same one from a checkpoint
    saved after planning: then every step is the same arithmetic, on numpy or as TF ops."""
    variables, on_numpy = make_variables(), scheduled("topk:density=0.05", "mgwfbp")
    run_steps(variables, on_numpy, range(1))
    saved, weights = on_numpy.state_dict(), [w.numpy() for w in variables]
    run_steps(variables, on_numpy, range(1, STEPS))
    on_numpy.close()

    device_vars, on_device = make_variables(), scheduled("topk:density=0.05", "mgwfbp")
    for w, value in zip(device_vars, weights):
        w.assign(value)
    on_device.on_device = True
    on_device.load_state_dict(saved)
    run_steps(device_vars, on_device, range(1, STEPS))
    residuals = [p.memory.residual for _, p in on_device.planned.exchanges.pipelines.values()]
    assert residuals and all(isinstance(r, tf.Tensor) for r in residuals), "the buckets ran as TensorFlow ops"
    on_device.close()
    np.testing.assert_array_equal(flat(device_vars), flat(variables))
    assert_identical_across_ranks(flat(device_vars))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("spec", ["topk:density=0.05", "qsgd"])
def test_a_checkpoint_resumes_the_plan_bit_for_bit(spec, assert_identical_across_ranks):
    variables, compression = make_variables(), scheduled(spec, "optimal")
    run_steps(variables, compression, range(3))
    saved, weights = compression.state_dict(), [w.numpy() for w in variables]
    run_steps(variables, compression, range(3, 6))
    plan = compression.schedule_report["buckets"]
    compression.close()

    resumed_vars = make_variables()
    for w, value in zip(resumed_vars, weights):
        w.assign(value)
    resumed = scheduled(spec, "optimal")
    resumed.load_state_dict(saved)
    run_steps(resumed_vars, resumed, range(3, 6))
    assert resumed.schedule_report is None, "the saved plan is resumed, not profiled and planned again"
    assert resumed.last_step_timeline()["buckets"] and len(resumed.last_step_timeline()["buckets"]) >= len(plan)
    resumed.close()
    np.testing.assert_array_equal(flat(resumed_vars), flat(variables))
    assert_identical_across_ranks(flat(resumed_vars))


@pytest.mark.timeout(240)
def test_a_tf1_graph_runs_a_planned_schedule(comm, assert_identical_across_ranks):
    """TF1 style (a graph, hvd.DistributedOptimizer over a v1 optimizer, a Session): no
    automatic control dependencies, yet every arrival runs (the collecting call takes their
    outputs) and the step equals the oracle."""
    spec = "topk:density=0.05"
    oracle, names = None, [f"w{i}:0" for i in range(LAYERS)]
    try:
        with tf.Graph().as_default():
            variables = make_variables()
            x = tf.compat.v1.placeholder(tf.float32, [8, WIDTH])
            compression = scheduled(spec, "mgwfbp")
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.05), compression=compression)
            loss = loss_of(variables, x)
            grads_and_vars = opt.compute_gradients(loss, variables)
            local = tf.gradients(loss, variables)
            train = opt.apply_gradients(grads_and_vars)
            oracle = BucketOracle(spec, comm, {w.name: tuple(w.shape) for w in variables})
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                for i in range(STEPS):
                    reduced, grads, _ = session.run([[g for g, _ in grads_and_vars], local, train], {x: batch(i)})
                    oracle.check(dict(zip(names, reduced)), dict(zip(names, grads)))
                    if compression.schedule_report["buckets"] != oracle.names:
                        oracle.plan(compression.schedule_report["buckets"])
                final = np.concatenate([v.ravel() for v in session.run(variables)])
            compression.close()
    finally:
        if oracle is not None:
            oracle.close()
    assert_identical_across_ranks(final)
