"""The in-band compressors under a loss scaler's overflow, with P ranks simulated in one process.

A rank whose gradient (with its residual) holds inf or NaN sends NaN, so the summed payload is
NaN on every rank; every rank then returns NaN for the whole gradient and keeps its residual and
step counter; the step's other gradients, which committed, are rolled back when it is settled;
and the next step equals, bit for bit, that of a run that never saw the bad step.
Oracle: the numpy reference run on the same gradients minus the bad steps. The payloads are
summed here as Horovod's allreduce (op=Sum) would, in rank order; the real allreduce runs in
tests/parallel/*/test_overflow_in_band.py.
"""
import collections
import zlib

import numpy as np
import pytest
import tensorflow as tf
import torch

import horovod_sparse.tensorflow as hvd_tf
import horovod_sparse.torch as hvd_torch
from horovod_sparse.exchange import NonFiniteGradientError
from horovod_sparse.ops.base import random_indices
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.reference import ReferenceCompressor

P = 3
SHAPES = [(9, 7), (40,)]
SPEC = "randomk:density=0.2,seed=3"
FLOAT32_MAX = float(np.finfo(np.float32).max)
#: what a bad gradient holds at one element
BAD_VALUES = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan}


#: the frontends driven as ranks; "torch_device_flags" runs on the CPU what a GPU runs (the
#: overflow flags stay tensors: no synchronisation in compress)
FRAMEWORKS = ["numpy", "torch", "torch_device_flags", "tensorflow",
              pytest.param("torch_cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]


@pytest.fixture(params=FRAMEWORKS)
def framework(request, monkeypatch):
    if request.param == "torch_device_flags":
        monkeypatch.setattr(TorchOps, "all_finite", lambda self, t: torch.isfinite(t).all())
    return request.param


class Frontend:
    """One framework's compressor driven as a rank: numpy reference, PyTorch, or eager TensorFlow.
    ``names``: the gradients' keys (default: their positions), as in :func:`stream_of`."""

    def __init__(self, framework, spec=SPEC, names=None, **params):
        self.framework, self.names = framework.split("_")[0], names
        self.device = "cuda" if framework == "torch_cuda" else "cpu"
        make = {"numpy": ReferenceCompressor.from_spec, "torch": hvd_torch.Compression.from_spec,
                "tensorflow": hvd_tf.Compression.from_spec}[self.framework]
        self.compressor = make(spec, **params)

    def wrap(self, array):
        if self.framework == "torch":
            return torch.from_numpy(array.copy()).to(self.device)
        return tf.constant(array) if self.framework == "tensorflow" else array.copy()

    def compress(self, grad, key):
        name = key if self.names is None else self.names[key]
        if self.framework == "numpy":
            return self.compressor.compress(grad.copy(), name)
        if self.framework == "torch":  # positions: the gradients go in key order
            return self.compressor.compress(self.wrap(grad))
        return self.compressor.compress(tf.constant(grad), name=name)

    def decompress(self, summed, ctx):
        result = self.compressor.decompress(self.wrap(summed), ctx)
        return result.cpu().numpy() if isinstance(result, torch.Tensor) else np.asarray(result)

    def state(self):
        return self.compressor.state_dict()


def to_numpy(x):
    return x.cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def reduce_sum(payloads):
    """Horovod's allreduce with op=Sum: float32, in rank order (overflowing quietly, as it does)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.sum([to_numpy(p) for p in payloads], axis=0, dtype=np.float32)


def exchange(ranks, grads):
    """One step: every rank compresses each of its gradients, the payloads are summed over
    ranks, every rank decompresses. Returns ``results[rank][key]``."""
    compressed = [[rank.compress(g, key) for key, g in enumerate(rank_grads)] for rank, rank_grads in zip(ranks, grads)]
    summed = [reduce_sum([to_numpy(c[key][0]) for c in compressed]) for key in range(len(SHAPES))]
    return [[rank.decompress(summed[key], ctx) for key, (_, ctx) in enumerate(c)] for rank, c in zip(ranks, compressed)]


def gradients(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[[rng.standard_normal(s).astype(np.float32) for s in SHAPES] for _ in range(P)] for _ in range(steps)]


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["step"] == b[key]["step"], f"slot {key}: step {a[key]['step']} != {b[key]['step']}"
        np.testing.assert_array_equal(a[key]["residual"], b[key]["residual"], err_msg=f"slot {key}")


def stream_of(key, names=None):
    """The random stream of gradient ``key``: its position, or the CRC-32 of its name (horovod_sparse.slots)."""
    return key if names is None else zlib.crc32(names[key].encode())


def unsent_index(key, step, names=None):
    """An element of gradient ``key`` that randomk does not send at ``step``."""
    n = int(np.prod(SHAPES[key]))
    sent = set(random_indices(3, stream_of(key, names), step, n, int(np.ceil(0.2 * n))).tolist())
    return next(i for i in range(n) if i not in sent)


def overflowed(grads, step, value, rank, keys=None, index=None, names=None):
    """``grads`` with ``value`` at one element of each gradient in ``keys`` (default: all) on
    ``rank``: by default an element that is not sent at ``step``, so that only the NaN payload
    tells the other ranks."""
    out = [[g.copy() for g in rank_grads] for rank_grads in grads]
    for key in range(len(SHAPES)) if keys is None else keys:
        out[rank][key].reshape(-1)[unsent_index(key, step, names) if index is None else index] = value
    return out


@pytest.mark.parametrize("bad", list(BAD_VALUES))
@pytest.mark.parametrize("keys", [None, [1]], ids=["every_gradient", "one_gradient"])
@pytest.mark.parametrize("inspect", [True, False], ids=["saved_each_step", "settled_by_next_step"])
def test_overflow_changes_nothing_and_the_run_equals_one_without_it(framework, bad, keys, inspect):
    """An overflowed step (on one rank: every gradient, as a loss scaler's overflow, or one)
    leaves no state changed on any rank, and the run goes on as the oracle that never saw it,
    bit for bit. Where one gradient overflowed, the others committed and are rolled back when
    the step is settled: by state_dict() (``inspect``), or else by the next step's compress."""
    steps = gradients(7, seed=len(bad))
    bad_steps = {2, 3, 5}  # two in a row, and after state exists
    skipping = [Frontend(framework) for _ in range(P)]
    oracle = [Frontend("numpy") for _ in range(P)]
    committed = 0
    for step, grads in enumerate(steps):
        if step in bad_steps:
            before = [r.state() for r in skipping] if inspect else None
            results = exchange(skipping, overflowed(grads, committed, BAD_VALUES[bad], rank=step % P, keys=keys))
            for key in range(len(SHAPES)):
                nan = [np.isnan(rank_results[key]).all() for rank_results in results]
                assert nan == [keys is None or key in keys] * P, f"gradient {key}: NaN on ranks {nan}"
            for rank, state in zip(skipping, before or ()):
                assert_same_state(rank.state(), state)
            continue
        want, got = exchange(oracle, grads), exchange(skipping, grads)
        for rank in range(P):
            for key in range(len(SHAPES)):
                np.testing.assert_array_equal(got[rank][key], want[rank][key], err_msg=f"step {step} rank {rank} key {key}")
        committed += 1
    for rank, reference in zip(skipping, oracle):
        assert_same_state(rank.state(), reference.state())
        assert all(entry["step"] == committed for entry in rank.state().values())


def test_without_error_feedback_an_overflow_leaves_the_step_counters(framework):
    """No residual: the step counter (the random indices' seed) is the state, rolled back alike."""
    spec = SPEC + ",error_feedback=false"
    steps = gradients(5, seed=29)
    ranks, oracle = [Frontend(framework, spec) for _ in range(P)], [Frontend("numpy", spec) for _ in range(P)]
    for step, grads in enumerate(steps):
        if step == 2:
            exchange(ranks, overflowed(grads, 2, np.nan, rank=1, keys=[0]))
            continue
        for want, got in zip(exchange(oracle, grads), exchange(ranks, grads)):
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w)
    for rank, reference in zip(ranks, oracle):
        assert_same_state(rank.state(), reference.state())
        assert all(entry["step"] == 4 for entry in rank.state().values())


def test_finite_gradient_plus_residual_beyond_float32_is_an_overflow(framework):
    """Each of grad and residual is finite, their sum is not: caught on acc, not on the gradient."""
    ranks = [Frontend(framework) for _ in range(P)]
    j = unsent_index(0, 0)
    grads = gradients(1, seed=9)[0]
    grads[0][0].reshape(-1)[j] = FLOAT32_MAX  # kept in rank 0's residual (finite)
    exchange(ranks, grads)
    assert ranks[0].state()[0]["residual"][j] == np.float32(FLOAT32_MAX)
    before = [r.state() for r in ranks]
    results = exchange(ranks, overflowed(gradients(1, seed=10)[0], 1, FLOAT32_MAX, rank=0, keys=[0], index=j))
    for rank, state, rank_results in zip(ranks, before, results):
        assert np.isnan(rank_results[0]).all() and np.isfinite(rank_results[1]).all()
        assert_same_state(rank.state(), state)


def test_a_sum_that_overflows_on_the_wire_commits_nothing(framework):
    """Every rank's acc is finite, but their sum at a sent element exceeds float32: the reduced
    payload is inf, so the step is declined on every rank and the result is NaN everywhere."""
    ranks = [Frontend(framework) for _ in range(P)]
    n = int(np.prod(SHAPES[0]))
    sent = int(random_indices(3, 0, 0, n, int(np.ceil(0.2 * n)))[0])
    grads = gradients(1, seed=11)[0]
    for rank_grads in grads:
        rank_grads[0].reshape(-1)[sent] = FLOAT32_MAX
    results = exchange(ranks, grads)
    for rank, rank_results in zip(ranks, results):
        assert np.isnan(rank_results[0]).all()
        for entry in rank.state().values():
            assert entry["step"] == 0 and not entry["residual"].any()


def test_raise_raises_on_every_rank_and_changes_nothing(framework):
    ranks = [Frontend(framework, nonfinite="raise") for _ in range(P)]
    steps = gradients(2, seed=13)
    exchange(ranks, steps[0])
    before = [r.state() for r in ranks]
    bad = overflowed(steps[1], 1, np.inf, rank=2, keys=[1])
    compressed = [[rank.compress(g, key) for key, g in enumerate(rank_grads)] for rank, rank_grads in zip(ranks, bad)]
    summed = [reduce_sum([to_numpy(c[key][0]) for c in compressed]) for key in range(len(SHAPES))]
    for rank, c, state in zip(ranks, compressed, before):
        rank.decompress(summed[0], c[0][1])  # finite: committed, then rolled back with the step
        with pytest.raises(NonFiniteGradientError, match=r"overflowed this step.*no compressor state changed.*"
                                                         r"Skip this step.*nonfinite='propagate'"):
            rank.decompress(summed[1], c[1][1])
        assert_same_state(rank.state(), state)


def test_a_checkpoint_taken_right_after_an_overflow_resumes_bit_exact():
    """Saved right after a step in which one gradient overflowed (the other committed): the saved
    state is the one before that step, and a resumed run (here in PyTorch) goes on bit for bit."""
    steps = gradients(6, seed=17)
    ranks = [Frontend("numpy") for _ in range(P)]
    for grads in steps[:2]:
        exchange(ranks, grads)
    before = [r.state() for r in ranks]
    exchange(ranks, overflowed(steps[2], 2, np.nan, rank=0, keys=[0]))
    saved = [r.state() for r in ranks]
    resumed = [Frontend("torch") for _ in range(P)]
    for rank, state, earlier in zip(resumed, saved, before):
        assert_same_state(state, earlier)
        rank.compressor.load_state_dict(state)
    for grads in steps[3:]:
        for want, got in zip(exchange(ranks, grads), exchange(resumed, grads)):
            for w, g in zip(want, got):
                np.testing.assert_array_equal(g, w)


def test_torch_reuses_two_buffers_per_gradient():
    """acc goes into the slot's spare buffer and is swapped in on commit (the residual before it
    becomes the spare): no new buffer per step, overflowed steps included."""
    compressor = hvd_torch.Compression.randomk(density=0.2)
    seen = set()
    for step in range(6):
        grad = torch.randn(1000)
        payload, ctx = compressor.compress(grad.fill_(float("inf")) if step == 3 else grad)
        compressor.decompress(payload, ctx)
        slot = compressor.state.slots[0]
        seen |= {slot.residual.data_ptr(), slot.spare.data_ptr()}
    assert len(seen) == 2 and compressor.state_dict()[0]["step"] == 5


@pytest.mark.parametrize("spec", ["none", "fp16"])
def test_stateless_raise_checks_the_reduced_payload(spec):
    grad = torch.tensor([1.0, np.inf, 2.0])
    propagate, strict = hvd_torch.Compression.from_spec(spec), hvd_torch.Compression.from_spec(spec, nonfinite="raise")
    payload, ctx = propagate.compress(grad.clone())
    assert torch.isinf(propagate.decompress(payload, ctx)).any()  # Horovod's own behaviour
    payload, ctx = strict.compress(grad.clone())
    with pytest.raises(NonFiniteGradientError, match="overflowed"):
        strict.decompress(payload, ctx)
    payload, ctx = strict.compress(torch.ones(3))
    assert torch.equal(strict.decompress(payload, ctx), torch.ones(3))
    integers = torch.arange(3)
    assert torch.equal(strict.decompress(*strict.compress(integers)), integers)


def test_nonfinite_parameter_reaches_the_in_band_frontends():
    for frontend in (hvd_torch, hvd_tf):
        assert frontend.Compression.randomk(density=0.1, nonfinite="raise").nonfinite == "raise"
        assert frontend.Compression.from_spec("randomk:density=0.1,nonfinite=raise").nonfinite == "raise"
        assert frontend.Compression.fp16(nonfinite="raise").nonfinite == "raise"
        assert frontend.Compression.randomk(density=0.1).nonfinite == "propagate"
        with pytest.raises(ValueError, match=r"nonfinite must be one of \['propagate', 'raise'\], got 'skip'"):
            frontend.Compression.randomk(density=0.1, nonfinite="skip")
    assert ReferenceCompressor.from_spec("randomk", nonfinite="raise").nonfinite == "raise"
    # stateless ones passed uncalled, as Horovod's: the shared default instance propagates
    wire, ctx = hvd_torch.Compression.fp16.compress(torch.tensor([1.0, np.nan]))
    assert torch.isnan(hvd_torch.Compression.fp16.decompress(wire, ctx)[1])


NAMES = ["dense/kernel:0", "dense/bias:0"]
Variable = collections.namedtuple("Variable", "name")


def allreduce_grads(compressor, grads, vars):  # noqa: A002 (Horovod's frame: its names are what is looked up)
    """Compress a rank's gradients from a frame like Horovod's gradient allreduce, whose gradient
    list the TensorFlow frontend reads (keys are the variables' names)."""
    return [compressor.compress(g) for g in grads]


def graph_exchange(compressors):
    """One step inside tf.function: every simulated rank compresses (through a Horovod-like frame),
    the payloads are summed, every rank decompresses."""
    variables = [Variable(name) for name in NAMES]

    @tf.function
    def step(grads):
        compressed = [allreduce_grads(c, rank_grads, variables) for c, rank_grads in zip(compressors, grads)]
        summed = [tf.add_n([c[key][0] for c in compressed]) for key in range(len(SHAPES))]
        return [[c.decompress(summed[key], ctx) for key, (_, ctx) in enumerate(rank_c)]
                for c, rank_c in zip(compressors, compressed)]
    return step


@pytest.mark.parametrize("keys", [None, [0]], ids=["every_gradient", "one_gradient"])
@pytest.mark.parametrize("inspect", [True, False], ids=["saved_each_step", "settled_by_next_step"])
def test_tensorflow_graph_overflow_changes_nothing_and_the_run_equals_one_without_it(keys, inspect):
    """As the eager test, inside tf.function: the next step's settle is traced before the
    gradients' compress and rolls back, in the graph, the gradients that committed."""
    compressors = [hvd_tf.Compression.from_spec(SPEC) for _ in range(P)]
    oracle = [Frontend("numpy", names=NAMES) for _ in range(P)]
    step_fn = graph_exchange(compressors)
    committed = 0
    for step, grads in enumerate(gradients(6, seed=19)):
        bad = step in (1, 3, 4)
        fed = overflowed(grads, committed, [np.inf, -np.inf, np.nan][step % 3], rank=step % P, keys=keys,
                         names=NAMES) if bad else grads
        before = [c.state_dict() for c in compressors] if inspect else None
        results = step_fn([[tf.constant(g) for g in rank_grads] for rank_grads in fed])
        if bad:
            assert all(np.isnan(rank_results[0].numpy()).all() for rank_results in results)
            for c, state in zip(compressors, before or ()):
                assert_same_state(c.state_dict(), state)
            continue
        want = exchange(oracle, grads)
        for rank in range(P):
            for key in range(len(SHAPES)):
                np.testing.assert_array_equal(results[rank][key].numpy(), want[rank][key])
        committed += 1
    for c, reference in zip(compressors, oracle):
        assert_same_state(c.state_dict(), reference.state())


def test_tensorflow_graph_raise_fails_the_step_with_the_message_and_changes_nothing():
    compressors = [hvd_tf.Compression.from_spec(SPEC, nonfinite="raise") for _ in range(P)]
    step_fn = graph_exchange(compressors)
    grads = gradients(2, seed=23)
    step_fn([[tf.constant(g) for g in rank_grads] for rank_grads in grads[0]])
    before = [c.state_dict() for c in compressors]
    bad = overflowed(grads[1], 1, -np.inf, rank=0, keys=[1], names=NAMES)
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"NonFiniteGradientError: .*overflowed this step.*"
                                                             r"nonfinite='propagate'"):
        step_fn([[tf.constant(g) for g in rank_grads] for rank_grads in bad])
    for c, state in zip(compressors, before):
        assert_same_state(c.state_dict(), state)
