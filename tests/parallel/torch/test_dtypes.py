"""Gradients of every dtype Horovod can meet: float16/32/64, bfloat16, integers, empty."""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse.torch as hvds

SPECS = ["none", "fp16", "randomk:density=0.25"]


def round_trip(compressor, tensor, op=hvd.Average):
    payload, ctx = compressor.compress(tensor)
    reduced = hvd.allreduce(payload, op=op)
    return payload, compressor.decompress(reduced, ctx)


def kept_by_this_rank(compressor, grad, payload):
    """Dense float64 view of what this rank sent (random-k: its values at the shared indices)."""
    if not compressor.algorithm.name == "randomk":
        return payload.double().numpy().reshape(grad.shape)
    indices = compressor.ops.random_indices(compressor.algorithm.seed, 0, 0, grad.numel(), payload.numel())
    kept = np.zeros(grad.numel(), np.float64)
    kept[indices.numpy()] = payload.double().numpy()
    return kept.reshape(grad.shape)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_float_dtypes_come_back_in_their_dtype(spec, dtype, average_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    torch.manual_seed(hvd.rank())
    grad = torch.randn(6, 10).to(dtype)
    payload, result = round_trip(compressor, grad)
    assert result.dtype == dtype and result.shape == grad.shape
    assert payload.dtype != torch.bfloat16, "Horovod's allreduce rejects bfloat16"
    oracle = average_across_ranks(kept_by_this_rank(compressor, grad, payload))
    # Tolerance: the result is rounded to the gradient's dtype (and to float16 on the wire for fp16).
    tolerance = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    if spec == "fp16":
        tolerance = max(tolerance, 2e-3)
    np.testing.assert_allclose(result.double().numpy(), oracle, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("spec", SPECS)
def test_bfloat16_travels_as_float32(spec, average_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    grad = torch.full((8,), 1.0 + hvd.rank(), dtype=torch.bfloat16)
    payload, result = round_trip(compressor, grad)
    assert payload.dtype == torch.float32
    assert result.dtype == torch.bfloat16
    oracle = average_across_ranks(kept_by_this_rank(compressor, grad, payload))
    np.testing.assert_allclose(result.float().numpy(), oracle, rtol=1e-2)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("shape", [(0,), (0, 3)])
def test_zero_element_tensor(spec, shape):
    compressor = hvds.Compression.from_spec(spec)
    grad = torch.empty(shape)
    payload, result = round_trip(compressor, grad)
    assert payload.numel() == 0
    assert result.shape == grad.shape and result.dtype == grad.dtype


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_tensors_pass_untouched(spec, dtype):
    compressor = hvds.Compression.from_spec(spec)
    grad = torch.arange(12, dtype=dtype) * (hvd.rank() + 1)
    payload, ctx = compressor.compress(grad)
    assert payload is grad
    result = compressor.decompress(hvd.allreduce(payload, op=hvd.Sum), ctx)
    assert result.dtype == dtype
    expected = torch.arange(12, dtype=dtype) * sum(r + 1 for r in range(hvd.size()))
    assert torch.equal(result, expected)
