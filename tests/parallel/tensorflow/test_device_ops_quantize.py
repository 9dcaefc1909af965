"""The quantizers as TensorFlow ops on the gradients' device, checked on the CPU.

On a GPU (or with ``compression.on_device = True``) the TensorFlow frontend runs a quantizer's
step as TensorFlow ops on the fused float32 gradient: error feedback or Signum's momentum, the
scales, the codes (the stochastic ones from the same counter-based stream), the bit packing,
and after the exchange the decoding and summing; only the packed codes cross to numpy for MPI.
So here:

- every step equals the numpy path's bit for bit (the same float32 and integer operations and
  random numbers), and an independent numpy pipeline of the fused step (the oracle); replicas
  are identical;
- what crosses to numpy per step is the codes the codec says it sends (and the codes that come
  back), counted by :data:`~horovod_sparse.ops.host.HOST_TRAFFIC`, never a gradient (only the
  numpy path's arrays go uncounted: a count proves the codes were TensorFlow tensors).
"""
import math

import numpy as np
import pytest
import tensorflow as tf

from horovod_sparse.layout import GradientLayout
from horovod_sparse.ops.host import HOST_TRAFFIC

from device_steps import oracle_averages, random_targets, run_gradients  # tests/parallel/tensorflow


SHAPES = [(64, 40), (300,), (50, 30), (7,)]
STEPS = 5
SPECS = ["signsgd", "signsgd:method=allgather", "signum", "efsignsgd", "efsignsgd:method=allgather", "onebit",
         "onebit:bucket_size=100,method=allgather",
         "terngrad", "terngrad:method=allgather,error_feedback=True", "qsgd", "qsgd:levels=3,bucket_size=100",
         "qsgd:method=allgather", "int4", "int4:bits=3,bucket_size=100,method=allgather", "bf16",
         "bf16:error_feedback=True", "dense:method=alltoall",
         "dense:method=allgather", "dense:method=allreduce"]


def run(spec, on_device, targets, per_step=None):
    return run_gradients(spec, on_device, targets, SHAPES, 64, per_step)


def step_targets(seed):
    return random_targets(seed, SHAPES, STEPS)


def large_layout():
    large = [i for i, s in enumerate(SHAPES) if math.prod(s) >= 64]
    return large, GradientLayout([(i, SHAPES[i], "float32") for i in large])


def code_transfers(exchange):
    """(the transfers of codes this rank's step hands to numpy, those it gets back), in bytes,
    from the codec's own sizes (exchange.compressed: alltoall encodes every chunk, at P >= 3
    the owner's chunk again; allgather encodes the whole buffer)."""
    P, rank, nbytes = exchange.size, exchange.rank, exchange.chunk_nbytes
    if exchange.method == "allgather":
        whole = exchange.codec.nbytes(exchange.n)
        return [whole], [P * whole]
    if P == 2:
        return [sum(nbytes)], [sum(nbytes)]  # only the peer's codes come back
    return [sum(nbytes), nbytes[rank]], [P * nbytes[rank], sum(nbytes)]


@pytest.mark.parametrize("spec", SPECS)
def test_tensorflow_ops_give_the_numpy_paths_bits_and_the_oracles(spec, comm, assert_identical_across_ranks):
    targets = step_targets(7)
    counted = []
    _, on_numpy = run(spec, False, targets, per_step=lambda i, c: counted.append(HOST_TRAFFIC.bytes_out))
    assert counted == [0] * STEPS, "the numpy path hands numpy arrays to MPI: nothing counted"
    compression, on_device = run(spec, True, targets,
                                 per_step=lambda i, c: counted.append(HOST_TRAFFIC.bytes_out))
    assert all(b > 0 for b in counted[STEPS:]), "what crossed to numpy was a TensorFlow tensor"
    pipeline = compression.step_pipelines.pipeline
    memory = getattr(pipeline, "memory", None)
    if memory is not None and getattr(memory, "enabled", True):
        state = memory.momentum_buffer if pipeline.momentum is not None else memory.residual
        assert isinstance(state, tf.Tensor), "the memory lives in TensorFlow: the step ran as TensorFlow ops"
    wanted = oracle_averages(spec, comm, targets, SHAPES)
    for i, (want, numpy_result, device_result) in enumerate(zip(wanted, on_numpy, on_device)):
        for j, w in want.items():
            np.testing.assert_array_equal(device_result[j].view(np.int32), numpy_result[j].view(np.int32),
                                          err_msg=f"{spec} step {i}")
            np.testing.assert_allclose(device_result[j], w, rtol=1e-6, atol=1e-7, err_msg=f"{spec} step {i}")
            assert_identical_across_ranks(device_result[j])
        for j in set(range(len(SHAPES))) - set(want):  # Horovod's own allreduce
            np.testing.assert_array_equal(device_result[j], numpy_result[j])


@pytest.mark.parametrize("spec", ["signsgd", "signum", "efsignsgd", "onebit", "terngrad", "qsgd",
                                  "qsgd:method=allgather", "bf16", "dense:method=alltoall"])
def test_only_the_codes_leave_tensorflow(spec, comm):
    """Per step: out go this rank's packed codes (and headers), exactly what the codec sizes
    say; back come codes. 1-bit codes are about n/8 bytes: never a gradient-sized transfer."""
    _, layout = large_layout()
    n = layout.n

    def check(i, compression):
        exchange = compression.step_pipelines.pipeline.exchange
        out, back = code_transfers(exchange)
        assert HOST_TRAFFIC.bytes_out == sum(out), f"step {i}: only the codes leave"
        assert HOST_TRAFFIC.bytes_in == sum(back), f"step {i}: only codes return"
        assert HOST_TRAFFIC.largest == max(out + back), f"step {i}: no transfer beyond the codes"
        if spec.startswith("dense"):
            return
        bits = {"bf16": 16, "qsgd": 6, "terngrad": 2}.get(spec.split(":")[0], 1)
        P = exchange.size
        one_code = math.ceil(n * bits / 8) + 4 * (math.ceil(n / 512) + 3 * P)  # the codes, headers generously
        assert HOST_TRAFFIC.bytes_out <= 2 * one_code and HOST_TRAFFIC.bytes_out < n * 4, \
            f"step {i}: this rank's codes leave, never its gradient"
        assert HOST_TRAFFIC.largest <= P * one_code, f"step {i}: no transfer beyond the ranks' codes"
        if bits < 16:
            assert HOST_TRAFFIC.largest < n * 4, f"step {i}: no gradient-sized transfer"

    run(spec, True, step_targets(11), per_step=check)
