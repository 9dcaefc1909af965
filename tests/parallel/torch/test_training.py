"""Training through the stock hvd.DistributedOptimizer: replicas must stay bitwise identical."""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_sparse.torch as hvds

SPECS = ["none", "fp16", "randomk:density=0.1", "randomk:density=0.1,error_feedback=false"]


def make_model():
    torch.manual_seed(100 + hvd.rank())  # different on purpose: broadcast_parameters must fix it
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step, rank, size=8):
    """Deterministic per-(step, rank) data: every rank sees different samples."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(size, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


def flat_parameters(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def distributed(model, compression):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    return opt


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


@pytest.mark.parametrize("spec", SPECS)
def test_replicas_bitwise_identical_after_50_steps(spec, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(spec)
    opt = distributed(model, compression)
    start = flat_parameters(model).copy()
    losses = train(model, opt, range(50))
    params = flat_parameters(model)
    assert_identical_across_ranks(params)
    assert not np.allclose(params, start), "training did not move the parameters"
    assert np.mean(losses[-10:]) < np.mean(losses[:10]), "loss did not decrease"
    dense = sum(p.numel() * 4 for p in model.parameters())
    assert compression.dense_bytes_per_step == dense
    if spec.startswith("randomk"):
        assert compression.payload_bytes_per_step < 0.15 * dense


def test_sparse_embedding_gradients_reach_decompress_with_no_ctx(assert_identical_across_ranks):
    """nn.Embedding(sparse=True) skips compress, but Horovod calls decompress(output, None)."""
    torch.manual_seed(0)
    embedding = nn.Embedding(40, 8, sparse=True)
    head = nn.Linear(8, 3)
    model = nn.ModuleDict({"embedding": embedding, "head": head})
    compression = hvds.Compression.randomk(density=0.5)
    opt = distributed(model, compression)
    for step in range(5):
        g = torch.Generator().manual_seed(10 * hvd.rank() + step)
        tokens = torch.randint(0, 40, (6,), generator=g)
        opt.zero_grad()
        loss = head(embedding(tokens)).pow(2).mean()
        loss.backward()
        assert embedding.weight.grad.is_sparse
        opt.step()
    assert_identical_across_ranks(torch.cat([embedding.weight.detach().ravel(), head.weight.detach().ravel()]).numpy())
    assert set(compression.state.slots) == {"head.weight", "head.bias"}, \
        "only the dense head's weight and bias go through compress (slots keyed by parameter name)"


def test_checkpoint_resume_is_bitwise_identical_to_uninterrupted_run():
    """Save model, optimizer and compressor state after 5 steps; a fresh run restored from it
    matches the uninterrupted run bitwise at step 12."""
    model = make_model()
    compression = hvds.Compression.randomk(density=0.2)
    opt = distributed(model, compression)
    train(model, opt, range(5))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "compression": compression.state_dict()})
    train(model, opt, range(5, 12))
    uninterrupted = flat_parameters(model).copy()

    resumed_model = make_model()
    resumed_compression = hvds.Compression.randomk(density=0.2)
    resumed_opt = torch.optim.SGD(resumed_model.parameters(), lr=0.05, momentum=0.9)
    resumed_opt = hvd.DistributedOptimizer(resumed_opt, named_parameters=resumed_model.named_parameters(),
                                           compression=resumed_compression)
    resumed_model.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_compression.load_state_dict(checkpoint["compression"])
    train(resumed_model, resumed_opt, range(5, 12))
    np.testing.assert_array_equal(flat_parameters(resumed_model), uninterrupted)

    # Without the compressor's state (residuals, step counters) the run diverges: the test can fail.
    fresh_model = make_model()
    fresh_opt = torch.optim.SGD(fresh_model.parameters(), lr=0.05, momentum=0.9)
    fresh_opt = hvd.DistributedOptimizer(fresh_opt, named_parameters=fresh_model.named_parameters(),
                                         compression=hvds.Compression.randomk(density=0.2))
    fresh_model.load_state_dict(checkpoint["model"])
    fresh_opt.load_state_dict(checkpoint["optimizer"])
    train(fresh_model, fresh_opt, range(5, 12))
    assert not np.array_equal(flat_parameters(fresh_model), uninterrupted)
