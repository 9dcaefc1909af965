"""randomk through the stock hvd.DistributedOptimizer under a loss scaler's overflow.

A gradient that holds inf or NaN on one rank makes that gradient's result NaN on every rank
(its payload is NaN, and Horovod sums it), and the step leaves no state changed on any rank
(the gradients of it that committed are rolled back when it is settled). Skipped the GradScaler
way (synchronize, check every gradient, step only if all are finite), a run with overflows
injected at some steps equals, bit for bit, a run that never saw those steps. Also:
nonfinite="raise", a checkpoint right after an overflow, and a real torch.amp.GradScaler run
under fp16 autocast on the CPU.
"""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import horovod_sparse.torch as hvds
from horovod_sparse.exchange import NonFiniteGradientError
from test_training import batch, distributed, flat_parameters, make_model

SPEC = "randomk:density=0.1"
BAD_STEPS = (2, 3, 6)  # two in a row; each on rank step % P


def overflows_here(step, bad_steps):
    return step in bad_steps and hvd.rank() == step % hvd.size()


def step_skipping_overflow(model, opt, step, overflow=None):
    """One step the GradScaler way: synchronize, step only if every gradient is finite.
    ``overflow`` injects one on this rank: ``"every"`` multiplies the loss by inf (every
    gradient non-finite, as a loss scaler's overflow), ``"one"`` puts a NaN in the last layer's
    weight gradient only. Returns the reduced gradients and whether the step was taken."""
    x, y = batch(step, hvd.rank())
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    hook = model[2].weight.register_hook(lambda g: g.index_fill(1, torch.tensor([5]), float("nan"))) \
        if overflow == "one" else None
    (loss * float("inf") if overflow == "every" else loss).backward()
    if hook is not None:
        hook.remove()
    opt.synchronize()
    grads = [p.grad.clone() for p in model.parameters()]
    finite = all(bool(torch.isfinite(g).all()) for g in grads)
    if finite:
        with opt.skip_synchronize():
            opt.step()
    return grads, finite


def state_copy(compression):
    return copy.deepcopy(compression.state_dict())


def assert_same_state(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert a[key]["step"] == b[key]["step"], f"{key}: step {a[key]['step']} != {b[key]['step']}"
        np.testing.assert_array_equal(a[key]["residual"], b[key]["residual"], err_msg=key)


@pytest.mark.parametrize("overflow", ["every", "one"])
def test_overflowed_steps_change_nothing_and_the_run_equals_one_without_them(overflow, assert_identical_across_ranks):
    model, compression = make_model(), hvds.Compression.from_spec(SPEC)
    opt = distributed(model, compression)
    names = [name for name, _ in model.named_parameters()]
    for step in range(9):
        # steps 2 and 3 are settled by the next step's first compress, step 6 by state_dict()
        before = state_copy(compression) if step == 6 else None
        grads, finite = step_skipping_overflow(model, opt, step, overflow if overflows_here(step, BAD_STEPS) else None)
        assert finite == (step not in BAD_STEPS)
        if step in BAD_STEPS:  # NaN on every rank, whichever rank overflowed
            for name, grad in zip(names, grads):
                assert bool(torch.isnan(grad).all()) == (overflow == "every" or name == "2.weight"), name
        if before is not None:  # and no state changed
            assert_same_state(compression.state_dict(), before)
    params = flat_parameters(model)
    assert_identical_across_ranks(params)

    oracle_model, oracle_compression = make_model(), hvds.Compression.from_spec(SPEC)
    oracle_opt = distributed(oracle_model, oracle_compression)
    for step in (s for s in range(9) if s not in BAD_STEPS):
        step_skipping_overflow(oracle_model, oracle_opt, step)
    np.testing.assert_array_equal(params, flat_parameters(oracle_model))
    assert_same_state(compression.state_dict(), oracle_compression.state_dict())
    assert all(entry["step"] == 9 - len(BAD_STEPS) for entry in compression.state_dict().values())


def test_raise_raises_on_every_rank_and_changes_nothing():
    model, compression = make_model(), hvds.Compression.randomk(density=0.1, nonfinite="raise")
    opt = distributed(model, compression)
    step_skipping_overflow(model, opt, 0)
    before = state_copy(compression)
    x, y = batch(1, hvd.rank())
    opt.zero_grad()
    loss = F.cross_entropy(model(x), y)
    (loss * float("inf") if hvd.rank() == 1 % hvd.size() else loss).backward()
    with pytest.raises(NonFiniteGradientError, match=r"overflowed this step.*Skip this step"):
        opt.synchronize()  # every rank: the reduced payload is NaN everywhere
    assert_same_state(compression.state_dict(), before)


def test_a_checkpoint_right_after_an_overflow_resumes_bit_exact(assert_identical_across_ranks):
    model, compression = make_model(), hvds.Compression.from_spec(SPEC)
    opt = distributed(model, compression)
    for step in range(3):
        step_skipping_overflow(model, opt, step)
    before = state_copy(compression)
    step_skipping_overflow(model, opt, 3, overflow="one" if hvd.rank() == 0 else None)
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(),
                                "compression": compression.state_dict()})
    assert_same_state(checkpoint["compression"], before)
    for step in range(4, 9):
        step_skipping_overflow(model, opt, step)
    uninterrupted = flat_parameters(model)

    resumed, resumed_compression = make_model(), hvds.Compression.from_spec(SPEC)
    resumed_opt = hvd.DistributedOptimizer(torch.optim.SGD(resumed.parameters(), lr=0.05, momentum=0.9),
                                           named_parameters=resumed.named_parameters(),
                                           compression=resumed_compression)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    resumed_compression.load_state_dict(checkpoint["compression"])
    for step in range(4, 9):
        step_skipping_overflow(resumed, resumed_opt, step)
    np.testing.assert_array_equal(flat_parameters(resumed), uninterrupted)
    assert_identical_across_ranks(uninterrupted)


def test_grad_scaler_under_fp16_autocast_trains_through_its_overflows(assert_identical_across_ranks):
    """A real GradScaler whose initial scale overflows fp16: the first steps are skipped on
    every rank, the scale settles, the loss falls, and every gradient's step counter counts
    exactly the steps taken (in a step where only some gradients overflowed, the others are
    rolled back: their residual never holds a gradient scaled by a scale that overflowed)."""
    model, compression = make_model(), hvds.Compression.from_spec(SPEC)
    opt = distributed(model, compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 30)
    taken, losses, scales = 0, [], []
    for step in range(60):
        x, y = batch(step % 20, hvd.rank())
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        opt.synchronize()
        taken += all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
        scales.append(scaler.get_scale())
    params = flat_parameters(model)
    assert np.isfinite(params).all()
    assert_identical_across_ranks(params)
    assert_identical_across_ranks(np.array(scales))
    drops = [b < a for a, b in zip([2.0 ** 30] + scales, scales)]
    first_taken = drops.index(False)  # the scale fell at every step before: all skipped
    assert first_taken >= 3, f"the first steps did not overflow: {scales}"
    skipped = sum(drops)
    assert skipped - first_taken <= 3, f"the scale did not settle: {scales}"  # a later overflow now and then
    assert np.mean(losses[-10:]) < np.mean(losses[first_taken:first_taken + 10]), "loss did not decrease"
    assert taken == 60 - skipped
    assert all(entry["step"] == taken for entry in compression.state_dict().values())
