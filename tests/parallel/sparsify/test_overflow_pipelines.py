"""Every out-of-band pipeline under a loss scaler's overflow: a step whose gradient holds inf or
NaN on one rank raises NonFiniteGradientError on every rank, changes no state, and the next
step equals (bit for bit) that of a pipeline that never saw the bad step.

Oracle: a twin pipeline fed the same gradients minus the bad steps. Runs on numpy and on CPU
torch tensors (the kernels' other spelling)."""
import numpy as np
import pytest
import torch

import horovod_sparse
from horovod_sparse.exchange import ExchangeError, NonFiniteGradientError
from horovod_sparse.layout import GradientLayout

OUT_OF_BAND = [name for name in horovod_sparse.registry.available() if name not in ("none", "fp16", "randomk")]
LAYOUT = GradientLayout([("fc1.weight", (48, 40), "float32"), ("fc2.weight", (32, 48), "float32")])
#: what overflows: an inf or a NaN in the gradient, or a finite gradient whose sum with the
#: residual exceeds float32's range
BAD_VALUES = {"inf": np.inf, "-inf": -np.inf, "nan": np.nan, "huge": np.finfo(np.float32).max}


def _step(pipeline, grad):
    if hasattr(pipeline, "step_sparse"):
        indices, values = pipeline.step_sparse(grad)
        return np.concatenate([np.asarray(indices, np.float64), np.asarray(values, np.float64)])
    return np.asarray(pipeline.step(grad), np.float64)


def _state(pipeline):
    return {key: np.array(value, copy=True) for key, value in pipeline.state_dict().items()}


def _assert_same_state(before, after):
    assert before.keys() == after.keys()
    for key in before:
        assert np.array_equal(before[key], after[key], equal_nan=True), f"state field {key!r} changed"


def _gradients(comm, steps, seed):
    rng = np.random.default_rng(seed + 1000 * comm.rank)
    return [rng.standard_normal(LAYOUT.n).astype(np.float32) for _ in range(steps)]


@pytest.mark.parametrize("name", OUT_OF_BAND)
@pytest.mark.parametrize("bad", ["inf", "nan"])
def test_overflow_changes_nothing(comm, assert_identical_across_ranks, name, bad):
    algorithm = horovod_sparse.create(name)
    grads = _gradients(comm, 6, seed=len(name))
    bad_steps = {2, 4}  # after a first step, so that state (residual, carried threshold) exists
    with algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as skipping, \
            algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as oracle:
        for step, grad in enumerate(grads):
            if step in bad_steps:
                overflowed = grad.copy()
                if comm.rank == step % comm.size:  # a different rank each time
                    overflowed[step * 7] = BAD_VALUES[bad]
                before = _state(skipping)
                with pytest.raises(NonFiniteGradientError) as raised:
                    _step(skipping, overflowed)
                # a dense sum sees the overflow in the sum itself: it cannot tell whose it was
                assert raised.value.ranks == (() if name == "dense" else (step % comm.size,))
                _assert_same_state(before, _state(skipping))
                continue
            mine, theirs = _step(skipping, grad), _step(oracle, grad)
            assert np.array_equal(mine, theirs), f"step {step} differs from the run without the bad steps"
            assert_identical_across_ranks(mine)
        _assert_same_state(_state(oracle), _state(skipping))


@pytest.mark.parametrize("name", ["topk", "oktopk", "dgc", "efsignsgd", "powersgd", "fft"])
def test_residual_overflowing_float32_is_an_overflow(comm, name):
    """A finite gradient whose sum with the residual leaves float32's range is an overflow too:
    the accumulated buffer is what is checked, not the gradient alone."""
    algorithm = horovod_sparse.create(name)
    with algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipeline:
        big = np.full(LAYOUT.n, np.finfo(np.float32).max / 2, np.float32)
        big[::2] *= -1
        _step(pipeline, big)  # leaves (most of) it in the residual
        before = _state(pipeline)
        with pytest.raises(NonFiniteGradientError):
            _step(pipeline, big * np.float32(1.5) if comm.rank == 0 else np.zeros_like(big))
        _assert_same_state(before, _state(pipeline))


@pytest.mark.parametrize("name", ["topk", "qsgd", "powersgd", "fft", "dense"])
def test_torch_tensors_too(comm, name):
    """The same check on CPU torch tensors (numpy's kernels on zero-copy views) and with torch's
    own kernels (``numpy_on_cpu = False``, what a CUDA tensor runs)."""
    algorithm = horovod_sparse.create(name)
    for numpy_on_cpu in (True, False):
        with algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipeline:
            pipeline.numpy_on_cpu = numpy_on_cpu
            grads = [torch.from_numpy(g) for g in _gradients(comm, 2, seed=3)]
            _step(pipeline, grads[0])
            before = _state(pipeline)
            bad = grads[1].clone()
            if comm.rank == comm.size - 1:
                bad[-1] = float("nan")
            with pytest.raises(NonFiniteGradientError):
                _step(pipeline, bad)
            _assert_same_state(before, _state(pipeline))


def test_bad_input_wins_over_overflow(comm):
    """A rank with bad input (a wrong tag) and another with an overflow: the bad input is the
    error every rank raises (ExchangeError, not the overflow), so it is never taken for a skip."""
    algorithm = horovod_sparse.create("topk")
    with algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipeline:
        grad = _gradients(comm, 1, seed=5)[0]
        if comm.rank == 0:
            grad[0] = np.inf
        with pytest.raises(ExchangeError) as raised:
            pipeline.step_sparse(grad, tag=comm.rank)
        assert not isinstance(raised.value, NonFiniteGradientError)
        assert "disagree on tag" in str(raised.value)
