"""Training scripts as users write them (the TensorFlow side of tests/parallel/torch/test_training_scripts.py): variables without a
gradient, frozen variables, ``groups=``, compressors that differ across ranks, compressors
passed uncalled or built inside the traced step, and TF1-style graph mode.

One compressor of each mechanism: fp16 and randomk ride Horovod's allreduce, topk is a
sparsifier, qsgd a quantizer (with error feedback, so residuals matter), powersgd low rank.
Every gradient has >= 2048 elements, so it is really compressed. The oracle replays each
rank's gradients through independent references keyed by variable: the numpy frontend
(Horovod-allreduce compressors) or a numpy pipeline per exchanged buffer (the others).
"""
import time

import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse
import horovod_sparse.tensorflow as hvds
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import LayoutPipeline
from horovod_sparse.reference import ReferenceCompressor

from test_sparsifiers import data, flat_weights, make_model


SPECS = {"fp16": "fp16", "randomk": "randomk:density=0.1", "topk": "topk:density=0.05",
         "qsgd": "qsgd:error_feedback=True", "powersgd": "powersgd:rank=2"}
STATEFUL = ["randomk", "topk", "qsgd", "powersgd"]
SHAPES = {"A": (32, 64), "B": (32, 64), "C": (64, 40)}  # A and B alike: a residual swap would pass shape checks
#: which variables have a gradient at each step: B, then A, missing in turn (the swap guard)
PATTERNS = [("A", "B", "C"), ("A", "C"), ("B", "C"), ("A", "C"), ("B", "C"), ("A", "B", "C"), ("C",), ("A", "B", "C")]


def is_out_of_band(spec):
    return getattr(horovod_sparse.create(spec), "out_of_band", False)


class Oracle:
    """What Horovod must return per variable: independent references, one per variable for
    the compressors Horovod's allreduce carries; for an out-of-band compressor one numpy
    pipeline of the step's gradients whose state follows each variable (``after_backward``,
    the default), or with ``schedule="wfbp"`` one per variable (one per group under ``groups=1``)."""

    def __init__(self, spec, comm, average_across_ranks, grouped, schedule="after_backward"):
        self.spec, self.comm, self.average, self.grouped = spec, comm, average_across_ranks, grouped
        self.numpy = None if is_out_of_band(spec) else ReferenceCompressor.from_spec(spec)
        self.pipelines = {}
        self.step = LayoutPipeline(lambda layout: horovod_sparse.create(spec).make_pipeline(
            layout.n, comm, layout=layout)) if schedule == "after_backward" else None

    def reduce(self, named):
        """``named``: [(variable name, this rank's gradient)] in exchange order -> {name: result}."""
        if self.numpy is not None:
            return {name: self.average(self.numpy.decompress(*self.numpy.compress(g, name))) for name, g in named}
        if self.step is not None:
            layout = GradientLayout([(name, g.shape, "float32") for name, g in named])
            summed = self.step.for_layout(layout).step(layout.fuse([g for _, g in named]), tag=layout.tag)
            return dict(zip([name for name, _ in named], layout.split(summed / np.float32(self.comm.size))))
        buffers = [named] if self.grouped else [[item] for item in named]
        out = {}
        for buffer in buffers:
            layout = GradientLayout([(name, g.shape, "float32") for name, g in buffer])
            key = tuple(name for name, _ in buffer)
            if key not in self.pipelines:
                self.pipelines[key] = horovod_sparse.create(self.spec).make_pipeline(layout.n, self.comm,
                                                                                       layout=layout)
            summed = self.pipelines[key].step(layout.fuse([g for _, g in buffer]), tag=layout.tag)
            out.update(zip(key, layout.split(summed / np.float32(self.comm.size))))
        return out

    def close(self):
        for pipeline in self.pipelines.values():
            pipeline.close()
        if self.step is not None:
            self.step.close()


def gradient_fn(compression, variables, mode, groups=None):
    """A traced step returning Horovod's reduced gradients of ``sum(v * target)`` over the
    active variables: the others get a None gradient (``mode="none"``) or are left out of the
    list (``mode="frozen"``). ``active`` is a Python tuple, so each pattern is its own trace."""
    @tf.function
    def step(active, targets):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t, a in zip(variables, targets, active) if a])
        tape = hvd.DistributedGradientTape(tape, compression=compression, groups=groups)
        sources = variables if mode == "none" else [v for v, a in zip(variables, active) if a]
        return tape.gradient(loss, sources)
    return step


def check_against_oracle(compression, spec, mode, groups, comm, average_across_ranks, assert_identical_across_ranks,
                         seed=0):
    variables = [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES.items()]
    names = [v.name for v in variables]
    step = gradient_fn(compression, variables, mode, groups)
    oracle = Oracle(spec, comm, average_across_ranks, grouped=groups is not None,
                    schedule=getattr(compression, "schedule", None))
    rng = np.random.default_rng(seed + 1000 * hvd.rank())
    tolerance = 2e-3 if spec == "fp16" else 1e-6
    try:
        for pattern in PATTERNS:
            active = tuple(name in pattern for name in SHAPES)
            targets = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES.values()]
            results = step(active, [tf.constant(t) for t in targets])
            if mode == "none":
                assert [r is None for r in results] == [not a for a in active]
                results = [r for r in results if r is not None]
            want = oracle.reduce([(n, t) for n, t, a in zip(names, targets, active) if a])
            for name, result in zip([n for n, a in zip(names, active) if a], results):
                np.testing.assert_allclose(result.numpy(), want[name], rtol=tolerance, atol=tolerance,
                                           err_msg=f"{spec}: {name} at pattern {pattern}")
                assert_identical_across_ranks(result.numpy())
    finally:
        oracle.close()
    return names


# -- a variable without a gradient, frozen variables -------------------------------------
#: wfbp's pipelines per variable (or group) are the frontend's, the same for every out-of-band
#: compressor: checked with the sparsifier, whose selection depends most on what is in a buffer
SCHEDULED = [(name, "after_backward") for name in SPECS] + [("topk", "wfbp")]


@pytest.mark.parametrize("groups", [None, 1])
@pytest.mark.parametrize("mode", ["none", "frozen"])
@pytest.mark.parametrize("name,schedule", SCHEDULED)
def test_missing_and_frozen_variables_keep_their_own_state(name, mode, groups, schedule, comm, average_across_ranks,
                                                           assert_identical_across_ranks):
    """Variables drop out and come back (B and A in turn, same shape): every result equals the
    oracle that gives each variable its own residual, kept while it is away (after_backward: one
    exchange of the step's gradients; wfbp: one per variable, or per group under groups=1)."""
    spec = SPECS[name]
    compression = hvds.Compression.from_spec(spec, **({"schedule": schedule} if is_out_of_band(spec) else {}))
    names = check_against_oracle(compression, spec, mode, groups, comm, average_across_ranks,
                                 assert_identical_across_ranks)
    if name == "randomk":  # one residual and step counter per variable, counted only when present
        steps = {key: int(slot.step.numpy()) for key, slot in compression.state.slots.items()}
        assert steps == {n: sum(n[0] in p for p in PATTERNS) for n in names}
    if is_out_of_band(spec) and schedule == "wfbp" and groups is None:
        assert sorted(compression.pipelines) == sorted((n,) for n in names)
        assert {k[0]: s.step_count for k, (_, s) in compression.pipelines.items()} == \
            {n: sum(n[0] in p for p in PATTERNS) for n in names}
    if is_out_of_band(spec) and schedule == "after_backward":  # one exchange a step, whatever the grouping
        assert compression.pipelines == {}
        assert compression.step_pipelines.pipeline.step_count == len(PATTERNS)


@pytest.mark.parametrize("name", list(SPECS))
def test_freezing_a_layer_mid_training_keeps_replicas_identical(name, assert_identical_across_ranks):
    """10 steps, 10 with the first layer frozen (left out of the tape's sources), 10 again."""
    model = make_model()
    compression = hvds.Compression.from_spec(SPECS[name], **({"dense_below": 100} if is_out_of_band(SPECS[name])
                                                             else {}))
    opt = tf.keras.optimizers.SGD(0.05, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = data(hvd.rank())

    @tf.function
    def step(xb, yb, frozen):
        sources = model.layers[1].trainable_variables if frozen else model.trainable_variables
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        opt.apply_gradients(zip(tape.gradient(loss, sources), sources))
        return loss

    model(x[:1])
    hvd.broadcast_variables(model.variables, root_rank=0)
    first = model.layers[0].kernel
    for phase, frozen in enumerate([False, True, False]):
        before = first.numpy().copy()
        losses = [float(step(x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8], frozen)) for i in range(10 * phase, 10 * phase + 10)]
        assert np.all(np.isfinite(losses))
        assert_identical_across_ranks(flat_weights(model))
        assert np.array_equal(first.numpy(), before) == frozen, f"phase {phase}: the first layer moved iff not frozen"
    kernels = [model.layers[0].kernel.name, model.layers[1].kernel.name]
    if is_out_of_band(SPECS[name]):  # one exchange a step; the frozen kernel left it and came back
        assert compression.step_pipelines.pipeline.step_count == 30
        assert [e.key for e in compression.step_pipelines.layout.entries] == kernels
    elif name == "randomk":
        assert [int(compression.state.slots[k].step.numpy()) for k in kernels] == [20, 30]


# -- different parameters or seeds on different ranks ----------------------------------
DIFFERING = {"randomk": "randomk:density=0.1,seed={rank}", "topk": "topk:density=0.0{rank}5",
             "qsgd": "qsgd:levels={levels}", "powersgd": "powersgd:rank={levels}"}


@pytest.mark.parametrize("name", list(DIFFERING))
def test_different_parameters_across_ranks_fail_on_every_rank(name):
    spec = DIFFERING[name].format(rank=hvd.rank(), levels=2 ** (hvd.rank() + 1))
    compression = hvds.Compression.from_spec(spec)
    step = gradient_fn(compression, [tf.Variable(tf.zeros(s)) for s in SHAPES.values()], "none")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"ranks passed different compressors or parameters \(rank 0: .*rank 1: "):
        step((True, True, True), [tf.ones(s) for s in SHAPES.values()])
    assert time.monotonic() - started < 60


# -- compressors passed uncalled, as Horovod's are --------------------------------------
def test_stateless_compressor_passed_uncalled_works_like_horovods(comm, average_across_ranks,
                                                                  assert_identical_across_ranks):
    check_against_oracle(hvds.Compression.fp16, "fp16", "none", None, comm, average_across_ranks,
                         assert_identical_across_ranks)


@pytest.mark.parametrize("name", STATEFUL)
def test_stateful_compressor_passed_uncalled_says_to_call_it(name):
    step = gradient_fn(getattr(hvds.Compression, name), [tf.Variable(tf.zeros(s)) for s in SHAPES.values()], "none")
    with pytest.raises(TypeError, match=rf"Compression\.{name} was passed without calling it.*Compression\.{name}\("):
        step((True, True, True), [tf.ones(s) for s in SHAPES.values()])


# -- a compressor built inside the traced step ------------------------------------------
def train_step_building_compression(make, variables):
    @tf.function
    def step(targets):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
        tape = hvd.DistributedGradientTape(tape, compression=make())
        return tape.gradient(loss, variables)
    return step


def test_stateless_compressor_built_inside_the_step_works(average_across_ranks, assert_identical_across_ranks):
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES.values()]
    step = train_step_building_compression(lambda: hvds.Compression.fp16(), variables)
    rng = np.random.default_rng(40 + hvd.rank())
    for _ in range(3):
        targets = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
        for target, result in zip(targets, step([tf.constant(t) for t in targets])):
            want = average_across_ranks(target.astype(np.float16).astype(np.float32))
            np.testing.assert_allclose(result.numpy(), want, rtol=2e-3, atol=2e-3)
            assert_identical_across_ranks(result.numpy())


@pytest.mark.parametrize("name", STATEFUL)
def test_stateful_compressor_built_inside_the_step_fails_at_once(name):
    variables = [tf.Variable(tf.zeros(s)) for s in SHAPES.values()]
    step = train_step_building_compression(lambda: hvds.Compression.from_spec(SPECS[name]), variables)
    with pytest.raises(RuntimeError, match=rf"Compression\.{name}\(\.\.\.\) was created inside a tf\.function"
                                           r".*outside the step"):
        step([tf.ones(s) for s in SHAPES.values()])


@pytest.mark.parametrize("schedule", ["after_backward", "wfbp"])
@pytest.mark.parametrize("name", list(SPECS))
def test_tf1_graph_mode_session_initialises_the_compressors_variables(name, schedule, comm, average_across_ranks,
                                                                      assert_identical_across_ranks):
    """TF1 style: a graph, hvd.DistributedOptimizer over a v1 optimizer, a Session and
    global_variables_initializer. A plain graph has no automatic control dependencies: the
    residual updates must still run (randomk's step counters advance), and each out-of-band
    exchange's tf.cond must wait for the previous one's, so that ranks exchange in one order
    (wfbp; after_backward traces one exchange of the step, outside the tf.conds)."""
    if schedule == "wfbp" and not is_out_of_band(SPECS[name]):
        pytest.skip("schedules belong to the out-of-band compressors")
    spec = SPECS[name]
    oracle = Oracle(spec, comm, average_across_ranks, grouped=False, schedule=schedule)
    rng = np.random.default_rng(70 + hvd.rank())
    try:
        with tf.Graph().as_default() as graph:
            compression = hvds.Compression.from_spec(spec, **({"schedule": schedule} if is_out_of_band(spec) else {}))
            variables = [tf.compat.v1.get_variable(n, initializer=tf.zeros(s)) for n, s in SHAPES.items()]
            targets = [tf.compat.v1.placeholder(tf.float32, s) for s in SHAPES.values()]
            loss = tf.add_n([tf.reduce_sum(v * t) for v, t in zip(variables, targets)])
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=compression)
            grads_and_vars = opt.compute_gradients(loss, variables)
            train = opt.apply_gradients(grads_and_vars)
            with tf.compat.v1.Session() as session:
                session.run(tf.compat.v1.global_variables_initializer())
                assert len(session.run(tf.compat.v1.report_uninitialized_variables())) == 0
                for step in range(3):
                    values = [rng.standard_normal(s).astype(np.float32) for s in SHAPES.values()]
                    reduced, _ = session.run([[g for g, _ in grads_and_vars], train], dict(zip(targets, values)))
                    want = oracle.reduce([(v.name, t) for v, t in zip(variables, values)])
                    tolerance = 2e-3 if spec == "fp16" else 1e-6
                    for v, result in zip(variables, reduced):
                        np.testing.assert_allclose(result, want[v.name], rtol=tolerance, atol=tolerance, err_msg=f"step {step}: {v.name}")
                        assert_identical_across_ranks(result)
                assert_identical_across_ranks(np.concatenate([w.ravel() for w in session.run(variables)]))
                if name == "randomk":
                    assert [session.run(slot.step) for slot in compression.state.slots.values()] == [3, 3, 3]
            conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
            chained = [op for op in conds if any(t.op in conds for t in op.inputs)]
            assert len(chained) == (len(SHAPES) - 1 if is_out_of_band(spec) and schedule == "wfbp" else 0)
    finally:
        oracle.close()
