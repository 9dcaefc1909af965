"""The sparsifiers as TensorFlow ops on the gradients' device, checked on the CPU.

On a GPU the TensorFlow frontend runs a sparsifier's step as TensorFlow ops where the
gradients are (``tf.py_function``: error feedback, magnitude keys, the selection with its
carried threshold, the residual update), and only the selected pairs cross to numpy for the
exchange. ``compression.on_device = True`` runs the same on the CPU, so here:

- every step equals the numpy path's bit for bit (same float32 additions, integer key
  comparisons, exact selection), and an independent numpy oracle of the fused step;
- what crosses to numpy per step is the payload (the selected index/value pairs out, the summed
  pairs back), counted by :data:`~horovod_sparse.ops.host.HOST_TRAFFIC`, never a gradient.
"""
import math

import numpy as np
import pytest
import tensorflow as tf

from horovod_sparse.ops.host import HOST_TRAFFIC

from device_steps import oracle_averages, random_targets, run_gradients  # tests/parallel/tensorflow


SHAPES = [(64, 40), (300,), (50, 30)]
STEPS = 6
SPECS = ["topk:density=0.05", "oktopk:density=0.05", "gtopk:density=0.05", "gaussiank:density=0.05",
         "dgc:density=0.05", "threshold:value=1.5", "topk:density=0.05,exchange=dsa"]


def run(spec, on_device, targets, per_step=None):
    return run_gradients(spec, on_device, targets, SHAPES, 64, per_step)


def step_targets(seed):
    return random_targets(seed, SHAPES, STEPS)


@pytest.mark.parametrize("spec", SPECS)
def test_tensorflow_ops_give_the_numpy_paths_bits_and_the_oracles(spec, comm, assert_identical_across_ranks):
    targets = step_targets(7)
    _, on_numpy = run(spec, False, targets)
    compression, on_device = run(spec, True, targets)
    assert isinstance(compression.step_pipelines.pipeline.memory.residual, tf.Tensor), \
        "the residual lives in TensorFlow: the step ran as TensorFlow ops"
    wanted = oracle_averages(spec, comm, targets, SHAPES)
    for i, (want, numpy_result, device_result) in enumerate(zip(wanted, on_numpy, on_device)):
        for j, w in want.items():
            np.testing.assert_array_equal(device_result[j], numpy_result[j], err_msg=f"{spec} step {i}")
            np.testing.assert_allclose(device_result[j], w, rtol=1e-6, atol=1e-7, err_msg=f"{spec} step {i}")
            assert_identical_across_ranks(device_result[j])


@pytest.mark.parametrize("spec", ["topk:density=0.05", "oktopk:density=0.05", "dgc:density=0.05"])
def test_only_the_payload_leaves_tensorflow(spec, comm):
    """Per step: out go this rank's selected pairs (int64 index + float32 value each), back come
    the summed pairs; exact top-k sends exactly k pairs. Never a gradient-sized transfer."""
    n = sum(math.prod(s) for s in SHAPES if math.prod(s) >= 64)
    k = math.ceil(0.05 * n)
    pair = 8 + 4

    def check(i, compression):
        last = compression.step_pipelines.pipeline.last
        sent = int(last.local_indices.shape[0])
        assert HOST_TRAFFIC.bytes_out == sent * pair, f"step {i}: only the selected pairs leave"
        if spec.startswith("topk"):
            assert sent == k
        else:
            assert sent <= 2 * k
        assert 0 < HOST_TRAFFIC.bytes_in <= comm.size * 2 * k * pair, f"step {i}: only the summed pairs return"
        assert HOST_TRAFFIC.largest <= comm.size * 2 * k * 8 < n * 4, f"step {i}: no gradient-sized transfer"

    run(spec, True, step_targets(11), per_step=check)
