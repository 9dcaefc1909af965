"""A loss scaler's overflow through the stock ``hvd.DistributedOptimizer``: every out-of-band
compressor skips the overflowed step and only that step (:mod:`horovod_sparse.nonfinite`).

A step is skipped the way ``torch.amp.GradScaler`` does it under Horovod: ``synchronize()``,
check that every gradient is finite, then ``step()`` under ``skip_synchronize()`` only if so.
Oracle: the same training without the overflowed steps (same batches otherwise): the
parameters and the compressor's state must equal it bit for bit. Then a real GradScaler with
fp16 autocast on the CPU, whose first steps overflow.
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.agreement import allgather_int64, allgather_text, communicator_of
from horovod_sparse.checkpoint import gather_state, scatter_state
from horovod_sparse.exchange import NonFiniteGradientError

from grad_scaler import grad_scaler_step  # tests/parallel/torch

OUT_OF_BAND = [name for name in horovod_sparse.registry.available() if name not in ("none", "fp16", "randomk")]
STEPS = 8
BAD_STEPS = (2, 5)  # after state exists; on rank (step % P)


def make_model():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(1000 * hvd.rank() + step)
    x = torch.randn(8, 32, generator=g)
    return x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()


def distributed(model, compression):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return opt


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().copy()


def poison(model, how):
    """Make this rank's gradient overflow this step: a non-finite input (every gradient), an
    inf in one large weight's gradient only (only the compressor can tell the others), or in
    one small bias's only (it rides Horovod's own allreduce, beside the compressor's exchange)."""
    if how == "one_weight":
        handle = model[2].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([3]), float("inf")))
        return handle.remove
    if how == "one_bias":
        handle = model[4].bias.register_hook(lambda g: g.index_fill(0, torch.tensor([1]), float("inf")))
        return handle.remove
    return None


def step_like_grad_scaler(model, opt, step, bad_steps=(), how="input"):
    """One step, skipped (as GradScaler does) if any gradient is not finite. Returns whether it
    was applied, checked to be the same decision on every rank."""
    x, y = batch(step)
    overflowed_here = step in bad_steps and hvd.rank() == step % hvd.size()
    undo = None
    if overflowed_here and how == "input":
        x = x.clone()
        x[0, 0] = float("inf")
    elif overflowed_here:
        undo = poison(model, how)
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    if undo is not None:
        undo()
    opt.synchronize()
    finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    decisions = allgather_int64(communicator_of(None), [int(finite)])[:, 0]
    assert len(set(decisions.tolist())) == 1, f"ranks disagree on the overflow: {decisions}"
    if finite:
        with opt.skip_synchronize():
            opt.step()
    return finite


def train(spec, steps, bad_steps=(), how="input", **frontend):
    model = make_model()
    compression = hvds.Compression.from_spec(spec, **frontend)
    opt = distributed(model, compression)
    applied = [step_like_grad_scaler(model, opt, s, bad_steps, how) for s in steps]
    return model, compression, applied


def assert_same_state(a, b, where="state"):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same_state(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert np.array_equal(np.asarray(a), np.asarray(b)), f"{where} differs"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", OUT_OF_BAND)
def test_an_overflow_skips_that_step_only(name, assert_identical_across_ranks):
    model, compression, applied = train(name, range(STEPS), BAD_STEPS)
    assert applied == [s not in BAD_STEPS for s in range(STEPS)], "a step after the overflow was skipped too"
    oracle, oracle_compression, _ = train(name, [s for s in range(STEPS) if s not in BAD_STEPS])
    params = flat(model)
    assert np.array_equal(params, flat(oracle)), "the run with overflows differs from the run without those steps"
    assert_same_state(compression.state_dict(), oracle_compression.state_dict())
    assert_identical_across_ranks(params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["topk", "qsgd", "powersgd", "dense"])
@pytest.mark.parametrize("how", ["one_weight", "one_bias"])
def test_an_overflow_in_one_gradient(name, how, assert_identical_across_ranks):
    """Only one gradient of one rank overflows: a large one (only the compressor can tell the
    other ranks; its result is NaN on every rank) or a small one that Horovod carries as it is
    (the compressor's exchange is skipped all the same, so that its state does not take in
    gradients at the overflowed loss scale): every rank's scaler skips the step, and only it."""
    model, compression, applied = train(name, range(5), bad_steps=(3,), how=how)
    assert applied == [True, True, True, False, True]
    oracle, _, _ = train(name, [0, 1, 2, 4])
    assert np.array_equal(flat(model), flat(oracle))
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(120)
def test_the_overflowed_step_is_nan_for_every_out_of_band_gradient():
    model = make_model()
    opt = distributed(model, hvds.Compression.topk(density=0.05))
    step_like_grad_scaler(model, opt, 0)
    x, y = batch(1)
    if hvd.rank() == 0:
        x[1, 5] = float("nan")
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.synchronize()
    for name, p in model.named_parameters():
        if p.numel() >= 1024:  # the compressor's; the small ones ride Horovod's own allreduce
            assert torch.isnan(p.grad).all(), f"{name}: not NaN after an overflow on rank 0"
    with opt.skip_synchronize():
        pass  # skipped, as a scaler would


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", ["topk:density=0.05,warmup_steps=3", "oktopk:density=0.05,warmup_steps=3",
                                  "powersgd:warmup_steps=3"])
def test_an_overflowed_step_of_the_carried_warm_up_is_not_one_of_its_steps(spec, assert_identical_across_ranks):
    """The warm-up's dense steps ride Horovod's allreduce (its sums are not finite on every rank
    when one rank's gradient is not): one that overflows is not counted, so the ramp starts a
    step later, as in the oracle without that step; an overflow on the first compressed step
    after them is skipped as any other. The step counts equal the oracle's; parameters and state
    bit for bit where P is a power of 2, parameters within float32 rounding elsewhere."""
    bad = (1, 4)
    model, compression, applied = train(spec, range(8), bad)
    assert applied == [s not in bad for s in range(8)]
    oracle, oracle_compression, _ = train(spec, [s for s in range(8) if s not in bad])
    # bit for bit where P is a power of 2: elsewhere the order of Horovod's sums follows how its
    # fusion buffer was packed, which depends on timing (the same for Horovod's dense training)
    exact = hvd.size() & (hvd.size() - 1) == 0
    np.testing.assert_allclose(flat(model), flat(oracle), rtol=0 if exact else 1e-5, atol=0 if exact else 1e-8)
    state, oracle_state = compression.state_dict(), oracle_compression.state_dict()
    assert state["(fused)"]["step"] == oracle_state["(fused)"]["step"] == 8 - len(bad)
    if exact:
        assert_same_state(state, oracle_state)
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["topk", "efsignsgd", "powersgd", "dense", "topk:density=0.05,warmup_steps=3"])
def test_nonfinite_raise_raises_on_every_rank_and_keeps_the_state(name, assert_identical_across_ranks):
    model = make_model()
    compression = hvds.Compression.from_spec(name, nonfinite="raise")
    opt = distributed(model, compression)
    step_like_grad_scaler(model, opt, 0)
    before = compression.state_dict()
    x, y = batch(1)
    if hvd.rank() == hvd.size() - 1:
        x[0, 0] = float("inf")
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(NonFiniteGradientError) as raised:
        opt.synchronize()
    texts = allgather_text(communicator_of(None), str(raised.value))
    assert all(text == texts[0] for text in texts), texts
    assert "nonfinite='propagate'" in texts[0]
    assert_same_state(before, compression.state_dict())
    # the step is skipped, and training goes on from the state before it
    assert step_like_grad_scaler(model, opt, 2)
    assert_identical_across_ranks(flat(model))


def test_nonfinite_is_checked_at_construction():
    with pytest.raises(ValueError, match="nonfinite must be one of"):
        hvds.Compression.topk(density=0.01, nonfinite="skip")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["topk", "oktopk", "dgc", "powersgd", "fft", "signum"])
def test_a_checkpoint_right_after_an_overflow_resumes_bit_exact(name, assert_identical_across_ranks):
    model, compression, _ = train(name, range(3), bad_steps=(2,))
    saved = gather_state(compression)
    saved = saved if hvd.rank() == 0 else None
    model_state = {k: v.clone() for k, v in model.state_dict().items()}

    resumed = make_model()
    resumed.load_state_dict(model_state)
    again = hvds.Compression.from_spec(name)
    resumed_opt = distributed(resumed, again)
    scatter_state(again, saved)
    # momentum buffers: both optimizers start their momentum from this point (a fresh SGD each)
    continuing = make_model()
    continuing.load_state_dict(model_state)
    continued = hvds.Compression.from_spec(name)
    continued.load_state_dict(compression.state_dict())
    continuing_opt = distributed(continuing, continued)
    for s in range(3, 6):
        step_like_grad_scaler(resumed, resumed_opt, s)
        step_like_grad_scaler(continuing, continuing_opt, s)
    assert np.array_equal(flat(resumed), flat(continuing))
    assert_identical_across_ranks(flat(resumed))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["topk", "oktopk", "powersgd", "efsignsgd", "dgc", "fft", "dense"])
def test_real_grad_scaler_with_fp16_autocast_trains_on(name, assert_identical_across_ranks):
    """torch.amp.GradScaler, fp16 autocast on the CPU, an initial scale that overflows the fp16
    backward: the scaler skips a few steps while it lowers the scale, then training goes on."""
    model = make_model()
    compression = hvds.Compression.from_spec(name)
    opt = distributed(model, compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30, growth_interval=10)
    skipped, losses = 0, []
    for step in range(30):
        x, y = batch(step % 6)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        skipped += int(grad_scaler_step(opt, scaler, loss))
        losses.append(float(loss))
    params = flat(model)
    assert np.isfinite(params).all()
    assert skipped >= 3, f"the initial scale did not overflow (only {skipped} skipped steps)"
    assert skipped <= 20, f"{skipped} of 30 steps skipped: the compressor kept the overflow"
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), "the loss did not fall after the overflows"
    assert_identical_across_ranks(params)
