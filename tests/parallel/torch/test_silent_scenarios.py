"""Settings of real training scripts under which a compressor could give a result other than its
oracle without an error. Each either equals Horovod's own dense run (``dense`` and
``topk:density=1.0`` send everything, so their sums must be Horovod's, bit for bit) or fails
with a clear error on every rank. docs/guarantees.md lists them with their outcomes."""
import gc

import horovod.torch as hvd
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_sparse.torch as hvds
from horovod_sparse.agreement import allgather_text, communicator_of

pytestmark = pytest.mark.world_sizes(2, 3)  # one rank of three differing: a majority must not hide it

EXACT = ["dense", "topk:density=1.0"]


def assert_is_horovods(ours, horovods):
    """Bit for bit at P = 2 (a + b has one order); from P = 3 Horovod's ring sums in another
    order than the out-of-band exchange: equal up to float32 rounding."""
    if hvd.size() == 2:
        assert np.array_equal(ours, horovods)
    else:
        assert np.allclose(ours, horovods, rtol=1e-5, atol=1e-7)


def batch(step, width=32):
    g = torch.Generator().manual_seed(100 * hvd.rank() + step)
    x = torch.randn(8, width, generator=g)
    return x, (x[:, 0] > 0).long()


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 2))


def flat(module):
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()]).numpy()


def compression_of(spec):
    return hvd.Compression.none if spec == "horovod" else hvds.Compression.from_spec(spec)


def distributed(model, spec, **kwargs):
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(),
                                   compression=compression_of(spec), **kwargs)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def train(model, opt, steps, forward=None):
    forward = forward or model
    for step in range(steps):
        x, y = batch(step)
        opt.zero_grad()
        F.cross_entropy(forward(x).float(), y).backward()
        opt.step()
    return flat(model)


@pytest.mark.timeout(120)
def test_one_instance_for_two_optimizers_is_refused_on_every_rank():
    """Two nn.Sequential share parameter names: one instance would mix their residuals."""
    shared = hvds.Compression.topk(density=0.1)
    models = [mlp(1), mlp(2)]
    # (Horovod's own names prefixed, so that a refused step leaves no name clash for later tests)
    opts = [hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=[(f"model{i}.{n}", p) for n, p in m.named_parameters()],
                                     compression=shared) for i, m in enumerate(models)]
    train(models[0], opts[0], 1)
    with pytest.raises(ValueError) as raised:
        train(models[1], opts[1], 1)
    texts = allgather_text(communicator_of(None), str(raised.value))
    assert all(text == texts[0] for text in texts) and "one compressor per optimizer" in texts[0]


@pytest.mark.timeout(120)
def test_an_optimizer_made_again_after_the_first_is_gone_may_use_the_instance(assert_identical_across_ranks):
    compression = hvds.Compression.topk(density=0.1)
    model = mlp()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=compression)
    train(model, opt, 2)
    del opt
    gc.collect()
    model = mlp()  # a new model (Horovod's hooks stay on the old one's parameters)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    again = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                     named_parameters=model.named_parameters(), compression=compression)
    assert_identical_across_ranks(train(model, again, 2))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", EXACT)
def test_a_model_whose_dtype_changes_mid_training(spec, assert_identical_across_ranks):
    """model.double() after two steps: the layout changes, each gradient keeps its state. The
    out-of-band sum is float32 (float64 gradients are rounded to it, then written back as
    float64): Horovod's float64 sum up to that rounding, the float32 steps bit for bit."""
    def run(which, steps):
        model = mlp()
        opt = distributed(model, which)
        for step in range(steps):
            if step == 2:
                model.double()
            x, y = batch(step)
            opt.zero_grad()
            F.cross_entropy(model(x.to(next(model.parameters()).dtype)), y).backward()
            opt.step()
        return flat(model)
    assert_is_horovods(run(spec, 2), run("horovod", 2))
    ours, horovods = run(spec, 4), run("horovod", 4)
    assert np.allclose(ours, horovods, rtol=1e-6, atol=1e-7)
    assert_identical_across_ranks(ours)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", EXACT + ["topk:density=0.1"])
def test_parameters_without_gradient_in_some_steps_with_grads_set_to_none(spec, assert_identical_across_ranks):
    """torch 2's zero_grad() sets gradients to None; a branch used every other step has none then."""
    def run(which):
        torch.manual_seed(0)
        model = nn.ModuleDict({"a": nn.Linear(32, 64), "b": nn.Linear(32, 64), "head": nn.Linear(64, 2)})
        opt = distributed(model, which)
        for step in range(5):
            x, y = batch(step)
            opt.zero_grad()
            assert model["head"].weight.grad is None
            branch = model["a"] if step % 2 == 0 else model["b"]
            F.cross_entropy(model["head"](torch.relu(branch(x))), y).backward()
            opt.step()
        return flat(model)
    ours = run(spec)
    if spec in EXACT:
        assert_is_horovods(ours, run("horovod"))
    assert_identical_across_ranks(ours)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", EXACT)
def test_a_torch_compiled_model(spec):
    def run(which):
        model = mlp()
        return train(model, distributed(model, which), 3, forward=torch.compile(model))
    assert_is_horovods(run(spec), run("horovod"))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", EXACT)
@pytest.mark.parametrize("kwargs", [{"op": hvd.Sum}, {"gradient_predivide_factor": 2.0},
                                    {"backward_passes_per_step": 2}])
def test_horovods_reduction_settings(spec, kwargs):
    def run(which):
        model = mlp()
        opt = distributed(model, which, **kwargs)
        if "backward_passes_per_step" not in kwargs:
            return train(model, opt, 3)
        for step in range(4):  # two backward passes per optimizer step
            if step % 2 == 0:
                opt.zero_grad()
            x, y = batch(step)
            F.cross_entropy(model(x), y).backward()
            if step % 2 == 1:
                opt.step()
        return flat(model)
    assert_is_horovods(run(spec), run("horovod"))
