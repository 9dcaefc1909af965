"""Habits of Horovod users that must work (or fail clearly on every rank, never hang):
compressors passed uncalled, synchronize() then step(), per-rank parameters and environment
switches that must match, parameters without a gradient in some steps, and rank-0 checkpoints."""
import re
import warnings

import horovod.torch as hvd
import numpy as np
import pytest
import torch
from torch import nn

import horovod_sparse.checkpoint as checkpoint
import horovod_sparse.torch as hvds

WIDTH = 48  # 48 x 48 = 2304 elements: above dense_below, so the compressors really compress


class TwoHeads(nn.Module):
    """A trunk and two heads of the same shape, used in alternate steps: each step one
    head has no gradient, and the two swap places in the order of compress calls."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.trunk = nn.Linear(WIDTH, WIDTH)
        self.heads = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])

    def forward(self, x, step):
        return self.heads[step % 2](torch.relu(self.trunk(x)))


def data(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, WIDTH, generator=g)


def make(compression, model=None):
    torch.manual_seed(3)
    model = model or nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model, opt


def step_once(model, opt, step):
    x, y = data(step)
    opt.zero_grad()
    out = model(x, step) if isinstance(model, TwoHeads) else model(x)
    torch.nn.functional.mse_loss(out, y).backward()
    opt.step()


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()


def test_stateless_compressors_work_uncalled_like_horovods(assert_identical_across_ranks):
    ours, theirs = make(hvds.Compression.fp16), make(hvd.Compression.fp16)
    for step in range(3):
        step_once(*ours, step)
        step_once(*theirs, step)
    assert_identical_across_ranks(flat(ours[0]))
    # The same arithmetic as Horovod's fp16: identical bytes on and off the wire ...
    gradient = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(hvd.rank()))
    (wire_ours, ctx_ours), (wire_theirs, ctx_theirs) = (c.compress(gradient.clone()) for c in
                                                        (hvds.Compression.fp16, hvd.Compression.fp16))
    assert wire_ours.dtype == wire_theirs.dtype == torch.float16 and torch.equal(wire_ours, wire_theirs)
    assert torch.equal(hvds.Compression.fp16.decompress(wire_ours, ctx_ours),
                       hvd.Compression.fp16.decompress(wire_theirs, ctx_theirs))
    # ... so the same training, bit for bit where the sum's order is fixed (two ranks). At three
    # or more, Horovod's fusion buffer (its size depends on timing) can change MPI's reduction
    # order between the two runs, and fp16 sums round differently: equal to fp16 rounding.
    if hvd.size() == 2:
        assert np.array_equal(flat(ours[0]), flat(theirs[0]))
    else:
        np.testing.assert_allclose(flat(ours[0]), flat(theirs[0]), rtol=0, atol=1e-3)


@pytest.mark.parametrize("name, call", [("topk", "topk(density=0.01)"), ("randomk", "randomk(density=0.01)"),
                                        ("qsgd", "qsgd("), ("powersgd", "powersgd(")])
def test_stateful_compressors_passed_uncalled_say_to_call_them(name, call):
    model, opt = make(getattr(hvds.Compression, name))
    with pytest.raises(TypeError, match=rf"Compression\.{name} was passed without calling it.*"
                                        rf"Compression\.{re.escape(call)}"):
        step_once(model, opt, 0)


def test_different_seeds_on_ranks_fail_on_every_rank():
    model, opt = make(hvds.Compression.randomk(density=0.1, seed=hvd.rank()))
    with pytest.raises(ValueError, match=r"different compressors or parameters \(rank 0: randomk:.*seed=0; "
                                         r"rank 1: randomk:.*seed=1"):
        step_once(model, opt, 0)


# an exchange of its own (top-k, PowerSGD), and one that rides Horovod's allreduce (random-k)
@pytest.mark.parametrize("spec, variable", [("topk:density=0.05", "HOROVOD_SPARSE_KERNELS"),
                                            ("powersgd:rank=2", "HOROVOD_SPARSE_DEVICE_BUFFERS"),
                                            ("randomk:density=0.1", "HOROVOD_SPARSE_KERNELS")])
def test_a_switch_set_to_none_of_its_choices_on_one_rank_fails_on_every_rank(spec, variable, monkeypatch):
    if hvd.rank() == hvd.size() - 1:
        monkeypatch.setenv(variable, "fastest")
    model, opt = make(hvds.Compression.from_spec(spec))
    with pytest.raises(ValueError, match=rf"rank {hvd.size() - 1}: {variable} (is set to none|must be one) of"):
        step_once(model, opt, 0)


def test_synchronize_then_step_warns_and_goes_on_as_horovod_does(assert_identical_across_ranks):
    model, opt = make(hvds.Compression.fp16())
    for step in range(3):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.synchronize()
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            opt.step()  # without skip_synchronize(): Horovod warns and synchronizes again
    assert_identical_across_ranks(flat(model))


@pytest.mark.parametrize("spec", ["fp16", "none"])
def test_stateless_compressors_train_with_a_head_unused_every_other_step(spec, assert_identical_across_ranks):
    model, opt = make(hvds.Compression.from_spec(spec), TwoHeads())
    for step in range(4):
        step_once(model, opt, step)
    assert_identical_across_ranks(flat(model))


@pytest.mark.parametrize("spec", ["randomk:density=0.1", "topk:density=0.05", "qsgd"])
def test_rank0_checkpoint_restores_every_rank_bit_exactly(spec, tmp_path_factory, assert_identical_across_ranks):
    compression = hvds.Compression.from_spec(spec)
    model, opt = make(compression)
    for step in range(3):
        step_once(model, opt, step)
    saved = checkpoint.gather_state(compression)
    assert (saved is not None) == (hvd.rank() == 0)
    if hvd.rank() == 0:
        assert saved["world_size"] == hvd.size() and len(saved["ranks"]) == hvd.size()
    model_state = {k: v.clone() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    step_once(model, opt, 3)
    expected = flat(model)

    # Resume: a new compressor, its state from rank 0 only.
    resumed_compression = hvds.Compression.from_spec(spec)
    resumed, resumed_opt = make(resumed_compression)
    resumed.load_state_dict(model_state)
    resumed_opt.load_state_dict(opt_state)
    checkpoint.scatter_state(resumed_compression, saved if hvd.rank() == 0 else None)
    step_once(resumed, resumed_opt, 3)
    assert np.array_equal(flat(resumed), expected)
    assert_identical_across_ranks(flat(resumed))


def test_rank0_checkpoint_on_another_world_size_is_refused_on_every_rank():
    compression = hvds.Compression.randomk(density=0.1)
    model, opt = make(compression)
    step_once(model, opt, 0)
    saved = checkpoint.gather_state(compression)
    if hvd.rank() == 0:
        saved = dict(saved, world_size=hvd.size() + 1, ranks=saved["ranks"] + saved["ranks"][:1])
    with pytest.raises(ValueError, match=rf"saved on {hvd.size() + 1} ranks, this job has {hvd.size()}"):
        checkpoint.scatter_state(compression, saved)
    checkpoint.scatter_state(compression, saved, reset_on_resize=True)  # explicit: start from zero
    step_once(model, opt, 1)
