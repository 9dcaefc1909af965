"""One exchange through Horovod's allreduce equals the average of what each rank kept.

What a rank kept is computed independently by the numpy reference compressor
(replaying the same gradients with the same slot keys) and averaged with mpi4py.
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.reference import ReferenceCompressor

SPECS = ["none", "fp16", "randomk:density=0.1", "randomk:density=0.3,error_feedback=false",
         "randomk:density=1.0"]
SHAPES = [(7, 5), (33,), (2, 3, 4), (1,)]


def exchange_step(compressor, grads):
    """What hvd.DistributedOptimizer does: compress every gradient, allreduce, then decompress."""
    compressed = [compressor.compress(g) for g in grads]
    handles = [hvd.allreduce_async(p, op=hvd.Average) for p, _ in compressed]
    return [compressor.decompress(hvd.synchronize(h), ctx) for h, (_, ctx) in zip(handles, compressed)], \
        [p for p, _ in compressed]


@pytest.mark.parametrize("spec", SPECS)
def test_result_is_average_of_what_each_rank_kept(spec, average_across_ranks, assert_identical_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    reference = ReferenceCompressor.from_spec(spec)
    rng = np.random.default_rng(1000 + hvd.rank())
    for step in range(4):
        grads = [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]
        # copies: decompress may write its result into the gradient it was given, as Horovod's
        # own in-place allreduce does, and the reference below replays the original gradients
        results, payloads = exchange_step(compressor, [torch.tensor(g) for g in grads])
        for key, (grad, result, payload) in enumerate(zip(grads, results, payloads)):
            ref_payload, ref_ctx = reference.compress(grad, key)
            np.testing.assert_array_equal(payload.numpy(), ref_payload,
                                          err_msg=f"torch and numpy payloads differ ({spec}, step {step})")
            kept = reference.decompress(ref_payload, ref_ctx).astype(np.float32)
            oracle = average_across_ranks(kept)
            assert result.shape == grad.shape and result.dtype == torch.float32
            tolerance = 2e-3 if spec == "fp16" else 1e-6
            np.testing.assert_allclose(result.numpy(), oracle, rtol=tolerance, atol=tolerance)
            assert_identical_across_ranks(result.numpy())
    assert compressor.payload_bytes_per_step == sum(p.numel() * p.element_size() for p in payloads)


def test_randomk_conserves_what_is_not_sent():
    """kept + new residual == gradient + old residual, exactly, for every tensor and step."""
    compressor = hvds.Compression.randomk(density=0.2)
    rng = np.random.default_rng(7 + hvd.rank())
    residual = [np.zeros(int(np.prod(s)), np.float32) for s in SHAPES]
    for _ in range(3):
        grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
        compressed = [compressor.compress(g.clone()) for g in grads]  # decompress writes into what it got
        for payload, ctx in compressed:  # the state is committed in decompress
            compressor.decompress(payload.clone(), ctx)
        state = compressor.state_dict()
        for key, (grad, (payload, ctx)) in enumerate(zip(grads, compressed)):
            kept = np.zeros_like(residual[key])
            kept[ctx[0].numpy()] = payload.numpy()
            np.testing.assert_array_equal(kept + state[key]["residual"], grad.numpy().ravel() + residual[key])
            assert np.count_nonzero(state[key]["residual"][ctx[0].numpy()]) == 0
            residual[key] = state[key]["residual"]


def test_randomk_indices_agree_across_ranks(assert_identical_across_ranks):
    compressor = hvds.Compression.randomk(density=0.05, seed=11)
    rng = np.random.default_rng(hvd.rank())  # different values, same shapes
    for _ in range(3):
        payload, ctx = compressor.compress(torch.from_numpy(rng.standard_normal(1000).astype(np.float32)))
        assert_identical_across_ranks(ctx[0].numpy())
        compressor.decompress(payload, ctx)


def test_randomk_saved_state_does_not_change_with_training():
    """The residual is updated in place; a state_dict taken before must not follow it."""
    compressor = hvds.Compression.randomk(density=0.2)
    rng = np.random.default_rng(11 + hvd.rank())

    def step():
        grads = [torch.from_numpy(rng.standard_normal(s).astype(np.float32)) for s in SHAPES]
        exchange_step(compressor, grads)

    step()
    saved = compressor.state_dict()
    frozen = {key: entry["residual"].copy() for key, entry in saved.items()}
    step()
    for key, residual in frozen.items():
        np.testing.assert_array_equal(saved[key]["residual"], residual)
        assert not np.array_equal(compressor.state_dict()[key]["residual"], residual) or residual.size == 1
