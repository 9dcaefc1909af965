"""The compression warm-up (horovod_sparse.warmup) behind the stock hvd.DistributedOptimizer.

Per step, the step's decided compression: while dense, the result is Horovod's own allreduce
(it carries those steps, bit for bit, nothing goes out of band); on a ramp step of top-k, the sum of
every rank's top k_at(step) of its gradient + residual (a numpy oracle fed the local
gradients); afterwards the steady compression. The regime is reported, the replicas stay
bitwise identical, and a checkpoint taken at every step across the changes of regime
resumes bit for bit. ``auto`` spends its warm-up on fp16 before it profiles.
"""
import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse.torch as hvds
from horovod_sparse.layout import key_order
from horovod_sparse.warmup import Warmup

from test_schedules import distributed, five_layers, flat, local_gradients, train_step

WARMUP = 2
STEPS = 2 * WARMUP + 2


def compression_of(spec):
    return hvds.Compression.from_spec(spec, dense_below=0)


def assert_horovods_sums_equal(got, expected):
    """Horovod's sums of the same gradients, in two runs or two optimizers: bit for bit where P is
    a power of 2; at other P its reduction order follows how its fusion buffer was packed, which
    depends on timing, so within float32 rounding."""
    exact = hvd.size() & (hvd.size() - 1) == 0
    np.testing.assert_allclose(got, expected, rtol=0 if exact else 1e-5, atol=0 if exact else 1e-8)


def top_k_oracle(acc, k):
    """This rank's top k of acc by magnitude, ties to the lower index, densified."""
    keep = np.zeros_like(acc)
    order = np.lexsort((np.arange(acc.size), -np.abs(acc)))[:k]
    keep[order] = acc[order]
    return keep


def step_against_oracle(comm, model, opt, step, order, residual, k):
    """One training step checked against its oracle: every rank's top ``k`` of its gradient +
    ``residual`` (laid out in ``order``; all of it where k P >= n), summed over ranks. Returns
    the next residual and the step's reduced gradients."""
    local = local_gradients(model, step)
    acc = np.concatenate([local[name].ravel() for name in order]) + residual
    kept = acc if k * hvd.size() >= acc.size else top_k_oracle(acc, k)
    expected = np.zeros_like(kept)
    comm.Allreduce(kept, expected)
    reduced = train_step(model, opt, step)
    got = np.concatenate([reduced[name].ravel() for name in order])
    np.testing.assert_allclose(got, expected / hvd.size(), rtol=1e-5, atol=1e-7)
    return acc - kept, reduced


@pytest.mark.timeout(240)
def test_top_k_steps_follow_the_warm_up_against_oracles(comm, assert_identical_across_ranks):
    model = five_layers()
    compression = compression_of(f"topk:density=0.05,warmup_steps={WARMUP}")
    opt = distributed(model, compression)
    names = [name for name, _ in model.named_parameters()]
    reference = five_layers()   # Horovod's own dense, for the dense steps
    dense_opt = distributed(reference, hvd.Compression.none)
    order = sorted(names, key=key_order)   # the layout's order
    n = sum(p.numel() for p in model.parameters())
    steady = int(np.ceil(0.05 * n))
    ks = [n] * WARMUP + [max(int(np.ceil(0.05 ** (i / WARMUP) * n)), steady) for i in (1, 2)] + [steady] * 2
    residual, regimes = 0.0, []
    for step in range(STEPS):
        regimes.append(compression.regime())
        residual, reduced = step_against_oracle(comm, model, opt, step, order, residual, ks[step])
        dense = train_step(reference, dense_opt, step)
        if step < WARMUP:   # the dense warm-up is Horovod's own allreduce, nothing out of band
            for name in names:
                assert_horovods_sums_equal(reduced[name], dense[name])
            assert compression.pipelines == {}
        assert_identical_across_ranks(flat(model))
    assert regimes[1] == {"horovod": f"warm-up: dense until step {WARMUP}, on Horovod's allreduce"}
    assert regimes[WARMUP + 1]["whole_step"].startswith("warm-up: density")
    assert regimes[-1] == {"whole_step": "steady: density 0.05"}
    pipeline = compression.pipelines["whole_step"][1]
    assert pipeline.step_count == STEPS   # the carried steps counted in
    assert [pipeline.k_at(s) for s in range(STEPS)] == ks
    compression.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", [f"topk:density=0.05,warmup_steps={WARMUP}",
                                  f"oktopk:density=0.05,warmup_steps={WARMUP}",
                                  f"powersgd:rank=1,warmup_steps={WARMUP}"])
@pytest.mark.parametrize("save_at", range(1, STEPS))
def test_a_checkpoint_across_the_change_of_regime_resumes_bit_for_bit(spec, save_at, assert_identical_across_ranks):
    model, compression = five_layers(), compression_of(spec)
    opt = distributed(model, compression)
    for step in range(STEPS):
        if step == save_at:
            model_state = {k: v.clone() for k, v in model.state_dict().items()}
            opt_state, saved = opt.state_dict(), compression.state_dict()
        train_step(model, opt, step)
    compression.close()

    resumed, again = five_layers(), compression_of(spec)
    resumed.load_state_dict(model_state)
    opt = distributed(resumed, again)
    opt.load_state_dict(opt_state)
    again.load_state_dict(saved)
    for step in range(save_at, STEPS):
        train_step(resumed, opt, step)
    again.close()
    # bit for bit, except that steps of the warm-up Horovod carried are Horovod's own sums
    assert_horovods_sums_equal(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))


@pytest.mark.timeout(240)
def test_auto_warms_up_on_fp16_then_profiles(assert_identical_across_ranks):
    model = five_layers()
    compression = hvds.Compression.auto(dense_below=0, profile_steps=2, trial_steps=1, warmup_steps=WARMUP)
    opt = distributed(model, compression)
    phases, plans = [], []
    for step in range(WARMUP + 3):
        train_step(model, opt, step)
        phases.append(compression.auto_report["phase"])
        plans.append(set(compression.plan.values()))
    assert phases[:WARMUP - 1] == ["warming"] * (WARMUP - 1) and plans[0] == {"fp16"}
    assert phases[WARMUP - 1] == "profiling" and plans[WARMUP] == {"topk:density=0.01"}
    assert compression.auto_report["warmup_steps"] == WARMUP
    state = compression.state_dict()
    assert state["auto"]["steps"] == WARMUP + 3
    assert_identical_across_ranks(flat(model))
    compression.close()


QUANTIZER = "qsgd:levels=127,error_feedback=true"


def sgd_with_momentum(params, lr):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def train_with_auto(optimizer, **auto_args):
    """12 steps of the five-layer model under ``optimizer`` with a quick ``auto``: the model, the
    compressor and every choice its plan made."""
    model = five_layers()
    compression = hvds.Compression.auto(dense_below=0, profile_steps=2, trial_steps=1, warmup_steps=1, **auto_args)
    opt = hvd.DistributedOptimizer(optimizer(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    choices = set()
    for step in range(12):
        train_step(model, opt, step)
        choices |= set(compression.plan.values())
    return model, compression, choices


@pytest.mark.timeout(240)
@pytest.mark.parametrize("optimizer, name, kind, candidates", [
    (torch.optim.AdamW, "AdamW", "adaptive", None),                  # the default candidates
    (torch.optim.Adam, "Adam", "adaptive", ("fp16", "topk:density=0.01", QUANTIZER)),
    (sgd_with_momentum, "SGD", "momentum", ("fp16", "topk:density=0.01", "powersgd", QUANTIZER)),
])
def test_auto_under_adam_or_momentum_keeps_to_the_candidates_that_keep_quality(optimizer, name, kind, candidates,
                                                                               assert_identical_across_ranks):
    """Under Adam's family or SGD with momentum auto's quality guard keeps fp16, none, the
    8-bit quantizer with error feedback and int4 (a default candidate): top-k and PowerSGD at their
    defaults cost them 2-10% (docs/results/accuracy.md). Under plain SGD it keeps every candidate
    (test_auto_warms_up_on_fp16_then_profiles)."""
    chosen = {} if candidates is None else {"candidates": candidates}
    model, compression, choices = train_with_auto(optimizer, **chosen)
    report = compression.auto_report
    kept = ["fp16", QUANTIZER] + (["int4"] if candidates is None else [])
    assert report["phase"] == "settled" and choices & set(kept[1:]) and choices <= {"none", *kept}
    assert report["optimizer_guard"]["optimizer"] == name and report["optimizer_guard"]["kind"] == kind
    assert report["optimizer_guard"]["kept"] == kept
    assert_identical_across_ranks(flat(model))
    compression.close()


@pytest.mark.timeout(240)
def test_auto_with_guard_momentum_false_keeps_top_k_under_momentum(assert_identical_across_ranks):
    """``guard_momentum=False`` (a CNN under momentum SGD, where top-k lost nothing): auto keeps
    every candidate, profiles on top-k and says why in its report; replicas stay identical."""
    model, compression, choices = train_with_auto(sgd_with_momentum, guard_momentum=False,
                                                  candidates=("fp16", "topk:density=0.01", QUANTIZER))
    guard = compression.auto_report["optimizer_guard"]
    assert "topk:density=0.01" in choices
    assert guard["kind"] == "momentum" and guard["kept"] == ["fp16", "topk:density=0.01", QUANTIZER]
    assert_identical_across_ranks(flat(model))
    compression.close()


@pytest.mark.timeout(240)
def test_a_schedule_profiles_after_the_carried_warm_up(assert_identical_across_ranks):
    """With ``schedule="wfbp"`` the warm-up's dense steps ride Horovod's allreduce; the schedule
    profiles the compressed steps after them, plans, and its buckets count every step."""
    model = five_layers()
    compression = compression_of(f"topk:density=0.05,warmup_steps={WARMUP},schedule=wfbp")
    opt = distributed(model, compression)
    for step in range(WARMUP + 5):
        train_step(model, opt, step)
        if step < WARMUP:
            assert compression.schedule_report is None and compression.pipelines == {}
        assert_identical_across_ranks(flat(model))
    report = compression.schedule_report
    assert report is not None and report["chosen"] == "wfbp"
    assert compression.state_dict()["(fused)"]["step"] == WARMUP + 5
    compression.close()


@pytest.mark.timeout(240)
def test_the_ramps_dense_steps_ride_horovod_too(comm, assert_identical_across_ranks):
    """At density 0.2 the ramp's first count reaches n / P from P = 3 (0.2 ** 0.5 * P >= 1): that
    step is dense on every rank, so Horovod carries it as well; the pipeline then starts at the
    ramp's next step, and every step equals the oracle."""
    carried = 2 if hvd.size() < 3 else 3
    assert Warmup(WARMUP).dense_steps(0.2, hvd.size()) == carried
    model = five_layers()
    compression = compression_of(f"topk:density=0.2,warmup_steps={WARMUP}")
    opt = distributed(model, compression)
    order = sorted((name for name, _ in model.named_parameters()), key=key_order)
    n = sum(p.numel() for p in model.parameters())
    residual = 0.0
    for step in range(STEPS):
        regime = compression.regime()
        k = n if step < WARMUP else max(int(np.ceil(0.2 ** min((step - WARMUP + 1) / WARMUP, 1) * n)), int(np.ceil(0.2 * n)))
        residual, _ = step_against_oracle(comm, model, opt, step, order, residual, k)
        if step < carried:   # (the count is known from the first step on, with P)
            if step > 0:
                assert regime == {"horovod": f"warm-up: dense until step {carried}, on Horovod's allreduce"}
            assert compression.pipelines == {}
        assert_identical_across_ranks(flat(model))
    pipeline = compression.pipelines["whole_step"][1]
    assert pipeline.step_count == STEPS
    compression.close()
