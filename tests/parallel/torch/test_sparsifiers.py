"""Sparsifiers behind the stock hvd.DistributedOptimizer: oracle, replicas, ops, errors, checkpoints.

The oracle is independent of the package's selection code: exact top-k by a full
numpy argsort, the kept vectors summed with mpi4py.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_sparse.torch as hvds

SPARSIFIERS = ["topk:density=0.05", "topk:density=0.05,exchange=oktopk", "topk:density=0.05,exchange=dsa",
               "topk:density=0.05,exchange=gtopk", "oktopk:density=0.05", "gtopk:density=0.05",
               "gaussiank:density=0.05", "threshold:value=0.5", "dgc:density=0.05"]
SHAPES = [(64, 40), (40,), (300,), (10, 3)]  # 40 and 30 elements stay under dense_below=64


def exchange(compressor, grads, op=hvd.Average):
    """What hvd.DistributedOptimizer does: compress all, allreduce the payloads, then decompress."""
    compressed = [compressor.compress(g) for g in grads]
    handles = [hvd.allreduce_async(p, op=op) for p, _ in compressed]
    return [compressor.decompress(hvd.synchronize(h), ctx) for h, (_, ctx) in zip(handles, compressed)]


def exact_topk(values, k):
    return np.sort(np.argsort(-np.abs(values), kind="stable")[:k])


def test_topk_first_step_equals_independent_oracle(comm, average_across_ranks):
    compressor = hvds.Compression.topk(density=0.05, dense_below=64)
    rng = np.random.default_rng(300 + hvd.rank())
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    results = exchange(compressor, [torch.from_numpy(g) for g in grads])
    big = [g for g in grads if g.size >= 64]
    fused = np.concatenate([g.ravel() for g in big])
    kept = np.zeros_like(fused)
    local = exact_topk(fused, int(np.ceil(0.05 * fused.size)))
    kept[local] = fused[local]
    oracle = np.split(average_across_ranks(kept), np.cumsum([g.size for g in big])[:-1])
    for grad, result in zip(grads, results):
        expected = oracle.pop(0).reshape(grad.shape) if grad.size >= 64 else average_across_ranks(grad)
        np.testing.assert_allclose(result.numpy(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("spec", SPARSIFIERS)
def test_reduced_result_matches_what_ranks_kept(spec, comm, average_across_ranks, assert_identical_across_ranks):
    """Over several steps: result == average over ranks of each rank's kept values, on the
    globally selected indices, and what was kept + the new residual == the accumulated gradient."""
    compressor = hvds.Compression.from_spec(spec, dense_below=64)
    rng = np.random.default_rng(400 + hvd.rank())
    residual = None
    for step in range(4):
        grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
        results = exchange(compressor, [torch.from_numpy(g) for g in grads])
        (layout, sparsifier), = compressor.sparsifiers.values()
        info = sparsifier.last
        fused = np.concatenate([g.ravel() for g in grads if g.size >= 64])
        if spec.startswith("dgc"):
            assert np.all(np.isfinite(sparsifier.residual))
        else:
            acc = fused + (0 if residual is None else residual)
            kept = np.zeros_like(acc)
            kept[info.local_indices] = acc[info.local_indices]
            np.testing.assert_allclose(info.sent_values, acc[info.local_indices], rtol=0, atol=0)
            cleared = acc - sparsifier.residual
            # conservation: the residual holds exactly what was not cleared
            np.testing.assert_array_equal(sparsifier.residual + cleared, acc)
            oracle = average_across_ranks(kept)
            result = np.concatenate([r.numpy().ravel() for r, g in zip(results, grads) if g.size >= 64])
            np.testing.assert_allclose(result[info.selected], oracle[info.selected], rtol=1e-5, atol=1e-6)
            unselected = np.setdiff1d(np.arange(acc.size), info.selected)
            assert not np.any(result[unselected]), "values outside the global selection"
            residual = sparsifier.residual.copy()
        for r in results:
            assert_identical_across_ranks(r.numpy())


def test_sum_op_is_world_size_times_average():
    grads = [torch.from_numpy(np.random.default_rng(hvd.rank() + 9).standard_normal(s).astype(np.float32))
             for s in SHAPES]
    averaged = exchange(hvds.Compression.topk(density=0.1, dense_below=64), grads, op=hvd.Average)
    summed = exchange(hvds.Compression.topk(density=0.1, dense_below=64), grads, op=hvd.Sum)
    for a, s in zip(averaged, summed):
        np.testing.assert_allclose(s.numpy(), a.numpy() * hvd.size(), rtol=1e-5, atol=1e-6)


def test_adasum_is_refused():
    model = nn.Linear(100, 20)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(),
                                   compression=hvds.Compression.topk(density=0.1), op=hvd.Adasum)
    with pytest.raises(ValueError, match="Adasum"):
        model(torch.ones(2, 100)).sum().backward()  # Horovod compresses from the backward hooks
        opt.step()


def test_different_shapes_across_ranks_fail_on_every_rank():
    """Same sizes, different shapes on rank 1: Horovod's probes line up, our layout check must not."""
    compressor = hvds.Compression.topk(density=0.1, dense_below=0)
    shape = (20, 10) if hvd.rank() != 1 else (10, 20)
    with pytest.raises(ValueError, match="rank"):
        exchange(compressor, [torch.ones(shape)])


def batch(step, rank, size=8):
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(size, 32, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def make(spec, momentum=0.9):
    torch.manual_seed(100 + hvd.rank())
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    compression = hvds.Compression.from_spec(spec, dense_below=100)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt, compression


def train(model, opt, steps):
    losses = []
    for step in steps:
        x, y = batch(step, hvd.rank())
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.parametrize("spec", ["topk:density=0.05", "oktopk:density=0.05", "gtopk:density=0.05",
                                  "gaussiank:density=0.05", "threshold:value=0.01", "dgc:density=0.05",
                                  "topk:density=0.05,exchange=dsa"])
def test_replicas_bitwise_identical_after_100_steps(spec, assert_identical_across_ranks):
    model, opt, compression = make(spec, momentum=0.0 if spec.startswith("dgc") else 0.9)
    start = flat_parameters(model).copy()
    losses = train(model, opt, range(100))
    params = flat_parameters(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start)
    assert np.mean(losses[-20:]) < np.mean(losses[:20])
    (layout, _), = compression.sparsifiers.values()
    assert layout.n == 32 * 64 + 64 * 4  # the two weight matrices; the biases went dense


def test_checkpoint_resume_is_bitwise_identical():
    model, opt, compression = make("oktopk:density=0.05")
    train(model, opt, range(6))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "compression": compression.state_dict()})
    train(model, opt, range(6, 15))
    uninterrupted = flat_parameters(model).copy()

    model2, opt2, compression2 = make("oktopk:density=0.05")
    model2.load_state_dict(checkpoint["model"])
    opt2.load_state_dict(checkpoint["optimizer"])
    compression2.load_state_dict(checkpoint["compression"])
    train(model2, opt2, range(6, 15))
    np.testing.assert_array_equal(flat_parameters(model2), uninterrupted)


def demo_model_bytes(spec, steps=40):
    """Mean bytes this rank sent per step, and a dense ring allreduce's, for the demo's model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))  # the demo's model
    compression = hvds.Compression.from_spec(spec)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression)
    sent = []
    for step in range(steps):  # 40 steps include Ok-Topk's periodic exact selection (every 32)
        opt.zero_grad()
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        sent.append(compression.bytes_sent_per_step(hvd.size()))
    dense_ring = 2 * (hvd.size() - 1) / hvd.size() * compression.dense_bytes_per_step
    return float(np.mean(sent)), dense_ring


def test_oktopk_bytes_at_density_001_are_20x_below_dense():
    sent, dense_ring = demo_model_bytes("oktopk:density=0.01")
    assert sent * 20 <= dense_ring, f"oktopk: {sent:.0f} B/step vs dense {dense_ring:.0f}"


def test_gtopk_bytes_stay_within_its_tree_bound():
    """gTop-k: ceil(log2 P) rounds of k pairs plus k exact-sum values per tree edge, then the
    broadcast (the engine's bound), plus what Horovod carries for the small dense tensors."""
    sent, _ = demo_model_bytes("gtopk:density=0.01")
    k = int(np.ceil(0.01 * (64 * 128 + 128 * 10)))
    rounds = int(np.ceil(np.log2(hvd.size())))
    bound = rounds * k * (8 + 12) + 2 * (hvd.size() - 1) / hvd.size() * (128 + 10 + 2) * 4
    assert sent <= bound, f"gtopk: {sent:.0f} B/step, bound {bound:.0f}"


@pytest.mark.parametrize("spec", ["topk:density=0.01", "gaussiank:density=0.01", "dgc:density=0.01"])
def test_allgather_family_bytes_stay_within_the_topka_bound(spec):
    """TopkA sends each of its c pairs to P-1 peers: at most 2k(P-1) pairs' worth per rank for the
    estimated selections (count <= 2k), plus what Horovod carries for the small dense tensors."""
    sent, dense_ring = demo_model_bytes(spec)
    n, small = 64 * 128 + 128 * 10, 128 + 10
    k = int(np.ceil(0.01 * n))
    ring = 2 * (hvd.size() - 1) / hvd.size()
    bound = 2 * k * (hvd.size() - 1) * 8 + ring * (small + 2) * 4 + 16 * hvd.size()
    assert sent <= bound, f"{spec}: {sent:.0f} B/step, bound {bound:.0f}"


def test_backward_passes_per_step_compresses_the_accumulated_gradient(assert_identical_across_ranks):
    """With backward_passes_per_step=2 Horovod accumulates locally and compresses once per step."""
    torch.manual_seed(100 + hvd.rank())
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    compression = hvds.Compression.oktopk(density=0.05, dense_below=100)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=compression,
                                   backward_passes_per_step=2)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for step in range(10):
        opt.zero_grad()
        for micro in range(2):
            x, y = batch(2 * step + micro, hvd.rank())
            F.cross_entropy(model(x), y).backward()
        opt.step()
    (_, sparsifier), = compression.sparsifiers.values()
    assert sparsifier.step_count == 10
    assert_identical_across_ranks(flat_parameters(model))
