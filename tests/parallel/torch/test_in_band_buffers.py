"""The in-band compressors' buffer reuse under Horovod's real calls (horovod_sparse.ops.torch_ops).

``fp16`` casts into a wire buffer kept per gradient, and ``fp16``/``randomk`` write their result
into the gradient itself: under ``hvd.DistributedOptimizer`` (plain, grouped, with
``backward_passes_per_step=2``) the training equals Horovod's own ``Compression.fp16`` bit for
bit at two ranks, replicas stay identical, and the gradient's storage is kept; under
``hvd.allreduce`` and ``hvd.grouped_allreduce`` the input comes back unchanged and a result is
never overwritten by the next call.
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse.torch as hvds

WIDTH = 48


def make(compression, **kwargs):
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression, **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def train(model, opt, steps=3, passes=1):
    """``steps`` optimizer steps of ``passes`` backward passes each; the gradients' storage
    (data pointers) just before and after each ``synchronize()``."""
    pointers = []
    for step in range(steps):
        opt.zero_grad()
        for micro in range(passes):
            g = torch.Generator().manual_seed(1000 * hvd.rank() + 10 * step + micro)
            x, y = torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)
            torch.nn.functional.mse_loss(model(x), y).backward()
        before = [p.grad.data_ptr() for p in model.parameters()]
        opt.synchronize()
        pointers.append((before, [p.grad.data_ptr() for p in model.parameters()]))
        with opt.skip_synchronize():
            opt.step()
    return pointers


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


@pytest.mark.parametrize("kwargs", [{}, {"backward_passes_per_step": 2}, {"num_groups": 1}],
                         ids=["plain", "two_passes", "grouped"])
def test_fp16_trains_as_horovods_own_and_in_place(kwargs, assert_identical_across_ranks):
    passes = kwargs.get("backward_passes_per_step", 1)
    ours, theirs = make(hvds.Compression.fp16(), **kwargs), make(hvd.Compression.fp16, **kwargs)
    pointers = train(*ours, passes=passes)
    train(*theirs, passes=passes)
    assert_identical_across_ranks(flat(ours[0]))
    assert all(before == after for before, after in pointers)  # the result went into p.grad itself
    if hvd.size() == 2:  # a fixed order of the sum (see test_horovod_habits.py)
        assert np.array_equal(flat(ours[0]), flat(theirs[0]))
    else:
        np.testing.assert_allclose(flat(ours[0]), flat(theirs[0]), rtol=0, atol=1e-3)


@pytest.mark.parametrize("kwargs", [{}, {"backward_passes_per_step": 2}], ids=["plain", "two_passes"])
def test_randomk_trains_in_place_with_identical_replicas(kwargs, assert_identical_across_ranks):
    model, opt = make(hvds.Compression.randomk(density=0.1), **kwargs)
    pointers = train(model, opt, steps=4, passes=kwargs.get("backward_passes_per_step", 1))
    assert_identical_across_ranks(flat(model))
    assert all(before == after for before, after in pointers)
    assert np.isfinite(flat(model)).all()


@pytest.mark.parametrize("spec", ["fp16", "randomk:density=0.1"])
def test_allreduce_keeps_its_input_and_results(spec, assert_identical_across_ranks):
    compressor = hvds.Compression.from_spec(spec)
    inputs = [torch.randn(500, generator=torch.Generator().manual_seed(hvd.rank() * 10 + i)) for i in range(3)]
    kept = [t.clone() for t in inputs]
    results = [hvd.allreduce(t, name="in_band_buffers", compression=compressor) for t in inputs]
    firsts = [r.clone() for r in results]
    grouped = hvd.grouped_allreduce(inputs, name="in_band_buffers_grouped", compression=compressor)
    for t, k in zip(inputs, kept):
        assert torch.equal(t, k)  # hvd.allreduce's promise: the input unchanged
    for r, f in zip(results, firsts):
        assert torch.equal(r, f)  # not overwritten by the later calls
    for r, g in zip(results, grouped):
        assert_identical_across_ranks(r.numpy())
        assert_identical_across_ranks(g.numpy())
    if spec == "fp16":
        theirs = hvd.allreduce(kept[0], name="in_band_buffers_theirs", compression=hvd.Compression.fp16)
        assert torch.equal(results[0], theirs)
