"""One exchange inside tf.function equals the average of what each rank kept (numpy reference + mpi4py)."""
import horovod.tensorflow as hvd
import numpy as np
import pytest
import tensorflow as tf

import horovod_sparse.tensorflow as hvds
from horovod_sparse.reference import ReferenceCompressor

# the TensorFlow frontend's sums at an odd count too (the group's other modules run at 2)
pytestmark = pytest.mark.world_sizes(2, 3)

SPECS = ["none", "fp16", "randomk:density=0.1", "randomk:density=0.3,error_feedback=false",
         "randomk:density=1.0"]
SHAPES = [(7, 5), (33,), (2, 3, 4), (1,)]


def make_exchange(compressor):
    """Compress each gradient, allreduce with Horovod, decompress: as DistributedGradientTape does."""
    @tf.function
    def exchange(grads):
        compressed = [compressor.compress(g) for g in grads]
        reduced = [hvd.allreduce(p, op=hvd.Average) for p, _ in compressed]
        return [compressor.decompress(r, ctx) for r, (_, ctx) in zip(reduced, compressed)], \
            [p for p, _ in compressed]
    return exchange


@pytest.mark.parametrize("spec", SPECS)
def test_result_is_average_of_what_each_rank_kept(spec, average_across_ranks, assert_identical_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    reference = ReferenceCompressor.from_spec(spec)
    exchange = make_exchange(compressor)
    rng = np.random.default_rng(2000 + hvd.rank())
    for step in range(4):
        grads = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
        results, payloads = exchange([tf.constant(g) for g in grads])
        for key, (grad, result, payload) in enumerate(zip(grads, results, payloads)):
            ref_payload, ref_ctx = reference.compress(grad, key)
            np.testing.assert_array_equal(payload.numpy(), ref_payload,
                                          err_msg=f"TF and numpy payloads differ ({spec}, step {step})")
            oracle = average_across_ranks(reference.decompress(ref_payload, ref_ctx))
            tolerance = 2e-3 if spec == "fp16" else 1e-6
            np.testing.assert_allclose(result.numpy(), oracle, rtol=tolerance, atol=tolerance)
            assert_identical_across_ranks(result.numpy())
    if reference.algorithm.stateful:  # residuals live in tf.Variables and advance every call
        tf_state, ref_state = compressor.state_dict(), reference.state_dict()
        for key in range(len(SHAPES)):
            np.testing.assert_array_equal(tf_state[key]["residual"], ref_state[key]["residual"])
            assert tf_state[key]["step"] == ref_state[key]["step"] == 4


@pytest.mark.parametrize("spec", ["none", "fp16", "randomk:density=0.25"])
@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_float_dtypes_come_back_in_their_dtype(spec, dtype, average_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    reference = ReferenceCompressor.from_spec(spec)
    grad = np.random.default_rng(hvd.rank()).standard_normal((5, 8)).astype(np.float32)
    tensor = tf.cast(tf.constant(grad), dtype)
    result, payload = (x[0] for x in make_exchange(compressor)([tensor]))
    assert result.dtype.name == dtype and payload.dtype.name != "bfloat16"
    ref_payload, ref_ctx = reference.compress(tensor.numpy(), 0)
    oracle = average_across_ranks(reference.decompress(ref_payload, ref_ctx).astype(np.float64))
    # The result is rounded to the gradient's dtype, and summed in float16 on the wire for fp16.
    tolerance = max({"float64": 1e-12, "float16": 2e-3, "bfloat16": 1e-2}[dtype], 2e-3 if spec == "fp16" else 0)
    np.testing.assert_allclose(tf.cast(result, tf.float64).numpy(), oracle, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("spec", ["none", "fp16", "randomk:density=0.25"])
def test_zero_element_and_integer_tensors(spec):
    compressor = hvds.Compression.from_spec(spec)
    empty, integers = tf.zeros([0, 3]), tf.range(6, dtype=tf.int32) * (hvd.rank() + 1)

    @tf.function
    def exchange(empty, integers):
        (pe, ce), (pi, ci) = compressor.compress(empty), compressor.compress(integers)
        return (compressor.decompress(hvd.allreduce(pe, op=hvd.Average), ce),
                compressor.decompress(hvd.allreduce(pi, op=hvd.Sum), ci), pi)

    result_empty, result_int, payload_int = exchange(empty, integers)
    assert result_empty.shape == (0, 3)
    assert payload_int.dtype == tf.int32
    np.testing.assert_array_equal(payload_int.numpy(), integers.numpy())
    np.testing.assert_array_equal(result_int.numpy(), np.arange(6) * sum(r + 1 for r in range(hvd.size())))
