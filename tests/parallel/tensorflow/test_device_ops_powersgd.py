"""PowerSGD as TensorFlow ops on the gradients' device, checked on the CPU.

With ``compression.on_device = True`` (as on a GPU) the TensorFlow frontend's host call runs
PowerSGD's step on eager TensorFlow tensors: error feedback, P = M Q and Q = M^T P as
``tf.matmul``, the result and the residual as TensorFlow ops; only P with the dense vector, and
Q, cross to numpy for the two Allreduces (the Gram-Schmidt of the summed P stays on the host,
in float64 numpy). So here:

- given the Allreduced sums, the TensorFlow step is the numpy step's arithmetic bit for bit
  (the dense vector gathered and summed exactly, Gram-Schmidt on the host, the result and the
  residual as the same element-wise float32 products and sums in the same order), and the
  replicas are bitwise identical;
- the products P = M Q and Q = M^T P are TensorFlow's float32 matmul, not numpy's BLAS: each
  product may differ in its last bits (seen: 1 ulp-scale, ~1e-7 relative, at rank 1), and
  later steps carry that through the orthonormal basis, the warm-start Q and the residual. The
  TensorFlow step is compared with the numpy path and an independent numpy pipeline within
  ``TOLERANCE`` of the largest value (seen: ~1e-6 after 6 steps; PowerSGD's own approximation
  error is orders of magnitude larger); gradients on the dense part stay bit for bit;
- what crosses to numpy per step is the payload (P's, dense vector, Q's out), counted by
  :data:`~horovod_sparse.ops.host.HOST_TRAFFIC`, never a gradient.
"""
import math

import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse
from horovod_sparse.layout import GradientLayout
from horovod_sparse.lowrank import PowerSGDPipeline
from horovod_sparse.lowrank.orthogonal import orthonormalize
from horovod_sparse.ops.host import HOST_TRAFFIC

from device_steps import oracle_averages, random_targets, run_gradients  # tests/parallel/tensorflow


#: (64, 40), (50, 30) and (8, 4, 5) -> (8, 20) are compressed; (300,) is 1-D and (40, 3) is
#: too small to gain at rank 2 (120 < 2 * 2 * 43): both go to the dense vector
SHAPES = [(64, 40), (300,), (40, 3), (8, 4, 5), (50, 30)]
DENSE_BELOW = 64
STEPS = 6
SPECS = ["powersgd:rank=2", "powersgd:rank=2,warm_start=false", "powersgd:rank=1",
         "powersgd:rank=2,error_feedback=false"]
#: TensorFlow's float32 matmul vs numpy's BLAS, carried over the steps (module docstring),
#: relative to the largest magnitude of the compared gradient
TOLERANCE = 1e-4


def run(spec, on_device, targets, per_step=None):
    return run_gradients(spec, on_device, targets, SHAPES, DENSE_BELOW, per_step)


def step_targets(seed):
    return random_targets(seed, SHAPES, STEPS)


def matrix_of(shape):
    """PowerSGD's matrix view of a gradient: (shape[0], the rest), or None for 1-D."""
    return (shape[0], math.prod(shape[1:])) if len(shape) >= 2 else None


def compressed(shape, rank, rate=2.0):
    """The rank r of ``shape``'s factors, or 0 when it goes to the dense vector (the rule of
    PyTorch's powerSGD_hook, written out here)."""
    if matrix_of(shape) is None:
        return 0
    a, b = matrix_of(shape)
    r = min(rank, a, b)
    return r if r >= 1 and a * b >= rate * r * (a + b) else 0


def close(got, want, what):
    np.testing.assert_allclose(got, want, rtol=0, atol=TOLERANCE * float(np.abs(want).max()), err_msg=what)


@pytest.mark.parametrize("spec", SPECS)
def test_tensorflow_ops_match_the_numpy_path_and_the_oracle(spec, comm, assert_identical_across_ranks):
    targets = step_targets(7)
    _, on_numpy = run(spec, False, targets)
    compression, on_device = run(spec, True, targets)
    pipeline = compression.step_pipelines.pipeline
    assert isinstance(pipeline.last.kept, tf.Tensor), "the step ran as TensorFlow ops"
    if "error_feedback=false" not in spec:
        assert isinstance(pipeline.residual, tf.Tensor), "the residual lives in TensorFlow"
    rank = horovod_sparse.create(spec).rank
    large = [i for i, s in enumerate(SHAPES) if math.prod(s) >= DENSE_BELOW]
    assert [compressed(SHAPES[i], rank) > 0 for i in large].count(False) >= 1, "a dense part is exercised"
    wanted = oracle_averages(spec, comm, targets, SHAPES, DENSE_BELOW)
    for i, (want, numpy_result, device_result) in enumerate(zip(wanted, on_numpy, on_device)):
        assert sorted(want) == large
        for j, w in want.items():
            what = f"{spec} step {i} gradient {SHAPES[j]}"
            np.testing.assert_allclose(numpy_result[j], w, rtol=1e-6, atol=1e-7, err_msg=what)
            if compressed(SHAPES[j], rank):
                close(device_result[j], numpy_result[j], what)
                close(device_result[j], w, what)
            else:  # summed exactly by the first Allreduce: no matmul on the way
                np.testing.assert_array_equal(device_result[j], numpy_result[j], err_msg=what)
            assert_identical_across_ranks(device_result[j])


@pytest.mark.parametrize("spec", ["powersgd:rank=2", "powersgd:rank=1"])
def test_only_the_payload_leaves_tensorflow(spec, comm):
    """Per step out go this rank's P's and dense vector (one Allreduce), then its Q's (the
    second), float32; back come the orthonormal basis, the dense sum, the summed Q's and the
    next step's start Q's (the first step uploads its own start Q's too). Never a
    gradient-sized transfer."""
    rank = horovod_sparse.create(spec).rank
    large = [s for s in SHAPES if math.prod(s) >= DENSE_BELOW]
    factors = [(matrix_of(s), compressed(s, rank)) for s in large if compressed(s, rank)]
    p = sum(a * r for (a, _), r in factors)
    q = sum(b * r for (_, b), r in factors)
    dense = sum(math.prod(s) for s in large if not compressed(s, rank))
    largest_gradient = 4 * max(math.prod(s) for s in large)

    def check(i, compression):
        assert HOST_TRAFFIC.bytes_out == 4 * (p + dense + q), f"step {i}: only P, the dense vector and Q leave"
        first = q if i == 0 else 0
        assert HOST_TRAFFIC.bytes_in == 4 * (first + p + dense + q + q), \
            f"step {i}: only the basis, the dense sum, the summed Q's and the start Q's return"
        assert HOST_TRAFFIC.largest == 4 * max(p + dense, q), f"step {i}: the largest crossing is a payload"
        assert HOST_TRAFFIC.largest < largest_gradient, f"step {i}: no gradient-sized transfer"
        assert isinstance(compression.step_pipelines.pipeline.residual, tf.Tensor)

    run(spec, True, step_targets(11), per_step=check)


def expanded(p, q, size):
    """The first ``size`` elements (row-major) of p q^T as the sum over j of the outer products
    p[:, j] q[:, j]^T in order of j, float32 (the numpy path's element-wise arithmetic)."""
    out = p[:, 0, None] * q[:, 0]
    for j in range(1, p.shape[1]):
        out = out + p[:, j, None] * q[:, j]
    return out.ravel()[:size]


@pytest.mark.parametrize("warm_start", [True, False])
@pytest.mark.parametrize("with_layout", [True, False])
def test_given_the_sums_a_tensorflow_step_is_the_numpy_arithmetic_bit_for_bit(
        with_layout, warm_start, comm, assert_identical_across_ranks):
    """The pipeline directly, with the Allreduces recorded: from this rank's accumulated
    gradient and the sums every rank got, the result, the residual and the dense vector sent
    are recomputed in numpy and must be the TensorFlow step's bits. Without a layout the buffer
    is one zero-padded matrix with a short last row (1000 = 31 full rows of 32 + 8). Also the
    products themselves (TOLERANCE) and the numpy pipeline beside it. At rank 3 (8, 4, 5) goes
    to the dense vector too (160 < 2 * 3 * 28)."""
    shapes = [s for s in SHAPES if math.prod(s) >= DENSE_BELOW]
    layout = GradientLayout([(i, s, "float32") for i, s in enumerate(shapes)]) if with_layout else None
    n = layout.n if with_layout else 1000
    make = dict(rank=3, layout=layout, warm_start=warm_start)  # r >= 3: the order of the sums matters
    rng = np.random.default_rng(5 + 1000 * comm.rank)
    with PowerSGDPipeline(n, comm, **make) as on_tf, PowerSGDPipeline(n, comm, **make) as on_numpy:
        plan = on_tf.plan
        assert plan.matrices and (plan.dense_size > 0) == with_layout
        sums = []
        allreduce = on_tf._allreduce  # the pipeline's own Allreduce, recorded (test hook)
        on_tf._allreduce = lambda send, out: sums.append((send.copy(), allreduce(send, out).copy())) or out
        positions = plan.dense_positions()
        for step in range(STEPS):
            grad = rng.standard_normal(n).astype(np.float32)
            acc = grad + (on_tf.residual.numpy() if step else np.float32(0))
            starts = [on_tf._start_q(i, step, on_tf.q_matrices) for i in range(len(plan.matrices))]
            sums.clear()
            result = on_tf.step(tf.constant(grad))
            assert isinstance(result, tf.Tensor) and isinstance(on_tf.residual, tf.Tensor)
            result, residual = result.numpy(), on_tf.residual.numpy()
            (p_send, p_sum), (q_send, q_sum) = sums
            np.testing.assert_array_equal(p_send[plan.p_size:], acc[positions])
            np.testing.assert_array_equal(result[positions], p_sum[plan.p_size:])
            np.testing.assert_array_equal(residual[positions], 0)
            at_p = at_q = 0
            for block, start in zip(plan.matrices, starts):
                r, a, b = block.rank, block.rows, block.cols
                where = slice(block.offset, block.offset + block.size)
                m = np.zeros(a * b, np.float32)
                m[:block.size] = acc[where]
                m = m.reshape(a, b)
                basis = orthonormalize(p_sum[at_p:at_p + a * r].reshape(a, r))[0].astype(np.float32)
                local_q = q_send[at_q:at_q + b * r].reshape(b, r)
                summed_q = q_sum[at_q:at_q + b * r].reshape(b, r)
                what = f"step {step} block {block.key}"
                np.testing.assert_array_equal(result[where], expanded(basis, summed_q, block.size), err_msg=what)
                np.testing.assert_array_equal(residual[where], acc[where] - expanded(basis, local_q, block.size),
                                              err_msg=what)
                # tf.matmul, not BLAS: close, not equal
                close(p_send[at_p:at_p + a * r].reshape(a, r), m @ start.astype(np.float32), what + " P")
                close(local_q, m.T @ basis, what + " Q")
                at_p, at_q = at_p + a * r, at_q + b * r
            assert_identical_across_ranks(result)
            want = on_numpy.step(grad)
            close(result, want, f"step {step} vs the numpy pipeline")
            np.testing.assert_array_equal(result[positions], want[positions])
