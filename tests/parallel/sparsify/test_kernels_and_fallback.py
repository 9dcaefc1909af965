"""Every out-of-band pipeline with the compiled CPU kernels (horovod_sparse.ops.cpu) and with the
numpy path forced on (``numpy_only()``): the same sums, bit for bit, step after step, identical
on every rank, and the same state at the end; on numpy arrays and on CPU torch tensors.

Oracle: the numpy path (the reference every kernel replaces), run on the same gradients in
the same process by a second pipeline."""
import contextlib

import numpy as np
import pytest
import torch

import horovod_sparse
from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="numba is not installed")

OUT_OF_BAND = [name for name in horovod_sparse.registry.available() if name not in ("none", "fp16", "randomk")]
LAYOUT = GradientLayout([("fc1.weight", (96, 80), "float32"), ("fc1.bias", (96,), "float32"),
                         ("fc2.weight", (33, 96), "float32")])


def _result(pipeline, grad):
    if hasattr(pipeline, "step_sparse"):
        indices, values = pipeline.step_sparse(grad)
        return np.concatenate([np.asarray(indices).view(np.uint8), np.asarray(values).view(np.uint8)])
    return np.asarray(pipeline.step(grad)).view(np.uint8)


def _run(name, comm, grads, numpy_only):
    algorithm = horovod_sparse.create(name)
    outs = []
    with algorithm.make_pipeline(LAYOUT.n, comm, layout=LAYOUT) as pipeline, \
            (cpu.numpy_only() if numpy_only else contextlib.nullcontext()):
        for grad in grads:
            outs.append(_result(pipeline, grad).copy())
        state = {k: np.array(v, copy=True) for k, v in pipeline.state_dict().items()}
    return outs, state


@pytest.mark.parametrize("name", OUT_OF_BAND)
@pytest.mark.parametrize("library", ["numpy", "torch"])
def test_kernels_equal_the_numpy_path(comm, assert_identical_across_ranks, name, library):
    rng = np.random.default_rng(17 + comm.rank)
    grads = [(rng.standard_normal(LAYOUT.n) * (1 + step)).astype(np.float32) for step in range(5)]
    grads[1][::7] = np.float32(-0.0)
    grads[2][:50] = np.float32(0.25)  # ties
    if library == "torch":
        grads = [torch.from_numpy(g) for g in grads]
    compiled, compiled_state = _run(name, comm, grads, numpy_only=False)
    reference, reference_state = _run(name, comm, grads, numpy_only=True)
    for step, (mine, oracle) in enumerate(zip(compiled, reference)):
        assert np.array_equal(mine, oracle), f"step {step}: the kernels' sum differs from numpy's"
        assert_identical_across_ranks(mine)
    assert compiled_state.keys() == reference_state.keys()
    for key in compiled_state:
        assert np.array_equal(compiled_state[key], reference_state[key], equal_nan=True), key
