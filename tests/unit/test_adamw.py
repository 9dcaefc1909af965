"""horovod_sparse.torch.AdamW on one process: its update against torch's AdamW (every step exact)
and against a reference written here (a known pattern of exact and compressed steps), its
schedule, its checkpoints and its refusals. The compressor's side, and the real reports, are
in tests/parallel/torch/test_adamw.py."""
import copy
import doctest

import numpy as np
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse import exact_steps
from horovod_sparse.exact_steps import ExactSteps

STEPS = 24
SCHEDULE = ExactSteps(warmup=3, max_interval=4)   # exact: 0-2, 3, 4, 6, 10, 14, 18, 22


class RecordedReports:
    """What an out-of-band compressor reports after each exchange (``exact_report``), replayed
    from a known pattern; the optimizer reads it where ``hvd.DistributedOptimizer`` puts it."""

    def __init__(self, exact):
        self.exact, self.exact_report = list(exact), None

    def exchange(self, index):
        self.exact_report = (index, self.exact[index])


def gradients(shape, steps=STEPS, seed=0):
    """Recorded gradients; coordinate 0 is 0 on every step, coordinate 1 on every exact step
    only (error feedback's bursts: a coordinate the exact averages never saw)."""
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(shape, generator=g) for _ in range(steps)]
    for step, grad in enumerate(grads):
        grad.view(-1)[0] = 0.0
        if SCHEDULE.is_exact(step):
            grad.view(-1)[1] = 0.0
    return grads


def reference(p0, grads, exact, lr, betas, eps, weight_decay, decay="per_step", correct_v_by_steps=False):
    """AdamW with v and its bias correction on exact steps only, no step where v = 0: float64 numpy.
    ``decay`` "per_step": v decays by beta2 per step since its last exact step, its correction by
    the step of that exact step; "per_update": by beta2 per exact step, its correction by their
    count. ``correct_v_by_steps`` (per update): the pitfall, v's correction by the step count."""
    (b1, b2), p = betas, p0.astype(np.float64)
    m, v, updates, last = np.zeros_like(p), np.zeros_like(p), 0, 0
    for t, (g, is_exact) in enumerate(zip(grads, exact), start=1):
        p = p * (1 - lr * weight_decay)
        m = b1 * m + (1 - b1) * g
        if is_exact:
            updates += 1
            kept = b2 ** (t - last) if decay == "per_step" else b2
            v = kept * v + (1 - kept) * g * g
            last = t
        age = last if decay == "per_step" else t if correct_v_by_steps else updates
        v_hat = v / (1 - b2 ** age)
        ratio = np.divide(m / (1 - b1 ** t), np.sqrt(v_hat) + eps, out=np.zeros_like(m), where=v > 0)
        p = p - lr * ratio
    return p


def run(opt, params, grads, reports=None, schedulers=()):
    for step, grad in enumerate(grads):
        for p in params:
            p.grad = grad.clone()
        if reports is not None:
            reports.exchange(step)
        opt.step()
        for scheduler in schedulers:
            scheduler.step()


def test_the_schedules_doctests_and_edges():
    assert doctest.testmod(exact_steps).failed == 0
    for warmup in (0, 1, 5):
        for interval in (1, 2, 3, 7, 8, 64):
            s = ExactSteps(warmup, interval)
            exact = [step for step in range(400) if s.is_exact(step)]
            assert exact[:warmup + 1] == list(range(warmup + 1))          # the warm-up, then its next step
            gaps = np.diff(exact[warmup:])
            assert gaps.max(initial=1) <= interval and (gaps[1:] >= gaps[:-1]).all()  # growing, capped
            assert all(s.count(t) == sum(map(s.is_exact, range(t))) for t in range(0, 400, 7))
    for bad in (dict(warmup=-1), dict(max_interval=0), dict(max_interval=2.0), dict(compression="int4")):
        with pytest.raises(ValueError, match="exact_warmup|max_interval|exact_compression"):
            ExactSteps(**bad)


@pytest.mark.parametrize("maximize", [False, True])
def test_with_every_step_exact_it_is_torchs_adamw_bit_for_bit(maximize):
    """Without a compressor every step is exact: the same bits as torch.optim.AdamW (CPU), with
    two param groups and an LR scheduler."""
    torch.manual_seed(0)
    start = [torch.randn(6, 5), torch.randn(5)]
    ours = [p.clone().requires_grad_() for p in start]
    theirs = [p.clone().requires_grad_() for p in start]
    groups = lambda ps: [{"params": [ps[0]]}, {"params": [ps[1]], "lr": 3e-3, "weight_decay": 0.0}]
    opt_ours = hvds.AdamW(groups(ours), lr=1e-2, maximize=maximize)
    opt_theirs = torch.optim.AdamW(groups(theirs), lr=1e-2, maximize=maximize)
    sched = [torch.optim.lr_scheduler.StepLR(o, 5, 0.5) for o in (opt_ours, opt_theirs)]
    for step, grad in enumerate(gradients((6, 5))):
        for ps in (ours, theirs):
            ps[0].grad, ps[1].grad = grad.clone(), grad[0].clone()
        opt_ours.step(), opt_theirs.step()
        for s in sched:
            s.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert opt_ours.state[ours[0]]["exact_step"].item() == STEPS


BETAS = (0.9, 0.9)


@pytest.mark.parametrize("decay", ["per_step", "per_update"])
def test_exact_and_compressed_steps_against_the_reference(decay):
    """The known pattern (SCHEDULE) on recorded gradients: float32 against float64, to float32
    rounding (max relative error measured 7.8e-7, a few ulps); the coordinate no exact step saw does not
    move but by weight decay, the all-zero one does not either. beta2 = 0.9 (not 0.999), so that
    24 steps tell the two decays of v apart."""
    grads = gradients((40,))
    exact = [SCHEDULE.is_exact(step) for step in range(STEPS)]
    p = torch.randn(40, generator=torch.Generator().manual_seed(1)).requires_grad_()
    p0 = p.detach().numpy().copy()
    opt = hvds.AdamW([p], lr=1e-2, betas=BETAS, exact_warmup=3, max_interval=4, variance_decay=decay)
    opt._compression = RecordedReports(exact)   # where hvd.DistributedOptimizer keeps its compressor
    run(opt, [p], grads, opt._compression)
    expected = reference(p0, [g.numpy() for g in grads], exact, 1e-2, BETAS, 1e-8, 1e-2, decay)
    np.testing.assert_allclose(p.detach().numpy(), expected, rtol=2e-6, atol=1e-7)
    shrink = (1 - 1e-2 * 1e-2) ** STEPS  # weight decay's alone
    np.testing.assert_allclose(p.detach().numpy()[:2], p0[:2] * shrink, rtol=1e-6)
    assert opt.state[p]["exact_step"].item() == sum(exact) == 10 and opt.state[p]["step"].item() == STEPS
    assert opt.param_groups[0]["exchanged_steps"] == STEPS
    # the test tells them apart: the other decay; per update, the pitfall (per step, v's correction
    # by the steps is the rule, and the pitfall its near twin)
    wrong = [reference(p0, [g.numpy() for g in grads], exact, 1e-2, BETAS, 1e-8, 1e-2,
                       "per_update" if decay == "per_step" else "per_step")]
    if decay == "per_update":
        wrong.append(reference(p0, [g.numpy() for g in grads], exact, 1e-2, BETAS, 1e-8, 1e-2, decay,
                               correct_v_by_steps=True))
    for other in wrong:
        assert not np.allclose(p.detach().numpy(), other, rtol=1e-4, atol=0)


def test_a_state_dict_round_trip_across_an_exact_step_is_bit_exact():
    grads = gradients((12,))
    exact = [SCHEDULE.is_exact(step) for step in range(STEPS)]
    p = torch.ones(12, requires_grad=True)
    opt = hvds.AdamW([p], exact_warmup=3, max_interval=4)
    opt._compression = RecordedReports(exact)
    run(opt, [p], grads[:9], opt._compression)           # step 9 compressed, 10 exact
    saved, saved_p = copy.deepcopy(opt.state_dict()), p.detach().clone()
    for step in range(9, 14):
        p.grad = grads[step].clone()
        opt._compression.exchange(step)
        opt.step()
    q = saved_p.clone().requires_grad_()
    resumed = hvds.AdamW([q], exact_warmup=3, max_interval=4)
    resumed.load_state_dict(saved)
    assert resumed.exact_schedule == ExactSteps(3, 4, "none")
    resumed._compression = RecordedReports(exact)
    assert resumed.param_groups[0]["exchanged_steps"] == 9 and resumed.state[q]["exact_step"].item() == 6
    for step in range(9, 14):
        q.grad = grads[step].clone()
        resumed._compression.exchange(step)
        resumed.step()
    assert torch.equal(p, q)
    for key in ("exp_avg", "exp_avg_sq", "step", "exact_step", "variance_step"):
        assert torch.equal(opt.state[p][key], resumed.state[q][key])


def test_a_checkpoint_saved_before_variance_decay_resumes_as_it_ran():
    """A state_dict without ``variance_decay`` (per group) and ``variance_step`` (per parameter),
    as saved before they were kept, resumes under the rule it ran with (per update), bit for bit."""
    grads = gradients((12,))
    exact = [SCHEDULE.is_exact(step) for step in range(STEPS)]
    p = torch.ones(12, requires_grad=True)
    opt = hvds.AdamW([p], betas=BETAS, exact_warmup=3, max_interval=4, variance_decay="per_update")
    opt._compression = RecordedReports(exact)
    run(opt, [p], grads[:9], opt._compression)
    saved, saved_p = copy.deepcopy(opt.state_dict()), p.detach().clone()
    del saved["param_groups"][0]["variance_decay"]
    del saved["param_groups"][0]["exact_compression"]
    for state in saved["state"].values():
        del state["variance_step"]
    for step in range(9, STEPS):
        p.grad = grads[step].clone()
        opt._compression.exchange(step)
        opt.step()
    q = saved_p.clone().requires_grad_()
    resumed = hvds.AdamW([q], betas=BETAS, exact_warmup=3, max_interval=4)   # today's default: per step
    resumed.load_state_dict(saved)
    resumed._compression = RecordedReports(exact)
    for step in range(9, STEPS):
        q.grad = grads[step].clone()
        resumed._compression.exchange(step)
        resumed.step()
    assert torch.equal(p, q)


def test_a_report_out_of_step_or_against_the_schedule_fails():
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = hvds.AdamW([p], exact_warmup=1, max_interval=1)
    opt._compression = RecordedReports([True, False])
    opt.step()                                    # no exchange yet (broadcast_optimizer_state's step): exact
    assert opt.param_groups[0]["exchanged_steps"] == 0
    opt._compression.exchange(0)
    opt.step()
    with pytest.raises(RuntimeError, match="last exchanged step is 0, this optimizer expected step 1"):
        opt.step()                                # no new exchange
    opt._compression.exchange(1)
    with pytest.raises(RuntimeError, match="step 1 is exact on this optimizer's schedule"):
        opt.step()


@pytest.mark.parametrize("compression, accepted", [(hvds.Compression.none, True), (hvds.Compression.fp16, True),
                                                   ("fp16()", True), ("randomk", False)])
def test_in_band_compressors_exact_or_refused(compression, accepted):
    import horovod.torch as hvd
    if compression == "fp16()":
        compression = hvd.Compression.fp16
    elif compression == "randomk":
        compression = hvds.Compression.randomk(density=0.1)
    p = torch.ones(3, requires_grad=True)
    p.grad = torch.ones(3)
    opt = hvds.AdamW([p])
    opt._compression = compression
    if accepted:
        opt.step()
        assert opt.state[p]["exact_step"].item() == 1
    else:
        with pytest.raises(ValueError, match="does not report which steps are exact"):
            opt.step()


@pytest.mark.parametrize("kwargs, name", [(dict(amsgrad=True), "amsgrad"), (dict(foreach=True), "foreach"),
                                          (dict(fused=True), "fused"), (dict(capturable=True), "capturable"),
                                          (dict(lr=-1.0), "lr"), (dict(eps=-1.0), "eps"),
                                          (dict(weight_decay=-0.1), "weight_decay"),
                                          (dict(betas=(0.9, 1.0)), r"betas\[1\]"),
                                          (dict(max_interval=0), "max_interval"),
                                          (dict(exact_warmup=-1), "exact_warmup"),
                                          (dict(variance_decay="per_epoch"), "variance_decay"),
                                          (dict(exact_compression="bf16"), "exact_compression")])
def test_bad_arguments_fail_at_construction(kwargs, name):
    with pytest.raises(ValueError, match=name):
        hvds.AdamW([torch.ones(2, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("other", [{"max_interval": 8}, {"exact_compression": "fp16"}])
def test_param_groups_must_share_the_schedule(other):
    opt = hvds.AdamW([{"params": [torch.ones(2, requires_grad=True)]},
                      {"params": [torch.ones(2, requires_grad=True)], **other}])
    with pytest.raises(ValueError, match="the same in every param group"):
        opt.exact_schedule
