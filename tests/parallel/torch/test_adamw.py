"""horovod_sparse.torch.AdamW through the stock ``hvd.DistributedOptimizer`` with an out-of-band
compressor: the exact steps are Horovod's own average, on every rank the same steps; replicas
stay bitwise identical; an overflowed step (a real GradScaler) moves no counter; a checkpoint
taken before a variance refresh resumes bit for bit. The update itself is checked against a
reference in tests/unit/test_adamw.py."""
import copy

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse.agreement import allgather_int64, communicator_of
from horovod_sparse.checkpoint import gather_state, scatter_state
from horovod_sparse.exact_steps import EXACT_CODES, ExactSteps
from horovod_sparse.layout import GradientLayout, key_order
from grad_scaler import grad_scaler_step
from test_schedules import five_layers, flat, local_gradients, loss_of, train_step

pytestmark = pytest.mark.world_sizes(2)  # the exact steps' bookkeeping, not the exchange, is the subject

SCHEDULE = dict(exact_warmup=3, max_interval=4)   # exact: 0-2, 3, 4, 6, 10, 14, 18, 22, 26
WARMUP = 2                                        # the compressor's own dense steps (exact too)
SPEC = f"topk:density=0.05,warmup_steps={WARMUP}"
STEPS = 30


def expected_exact(step):
    return step < WARMUP or ExactSteps(SCHEDULE["exact_warmup"], SCHEDULE["max_interval"]).is_exact(step)


def adamw(model, exact_compression="none", **frontend):
    compression = hvds.Compression.from_spec(SPEC, dense_below=0, **frontend)
    opt = hvd.DistributedOptimizer(hvds.AdamW(model.parameters(), lr=1e-2, exact_compression=exact_compression,
                                              **SCHEDULE),
                                   named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # a step on zero gradients, before any exchange
    return opt, compression


def counters(opt, compression):
    first = opt.param_groups[0]["params"][0]
    return (compression.steps_exchanged, opt.param_groups[0]["exchanged_steps"],
            int(opt.state[first]["step"]), int(opt.state[first]["exact_step"]))


def out_of_band_average(local, comm, exact_compression):
    """An exact step in 8 or 6 bits, computed apart: its EXACT_CODES numpy pipeline on this rank's
    gradients, fused in name order as the compressor fuses them, over P (collective)."""
    names = sorted(local, key=key_order)
    layout = GradientLayout([(name, local[name].shape, "float32") for name in names])
    with horovod_sparse.create(EXACT_CODES[exact_compression]).make_pipeline(layout.n, comm,
                                                                             layout=layout) as pipeline:
        parts = layout.split(pipeline.step(layout.fuse([local[e.key] for e in layout.entries]), tag=layout.tag)
                             / np.float32(hvd.size()))
    return {e.key: part.reshape(local[e.key].shape) for e, part in zip(layout.entries, parts)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule, exact_compression", [("after_backward", "none"), ("mgwfbp", "none"),
                                                         ("after_backward", "fp16"), ("mgwfbp", "int8"),
                                                         ("after_backward", "int6")])
def test_exact_steps_are_horovods_average_on_every_rank_and_replicas_agree(schedule, exact_compression, comm,
                                                                            assert_identical_across_ranks):
    """Also with a planned schedule (buckets on channel threads): its exchanges skip the exact
    steps. With ``exact_compression="fp16"`` the schedule's exact steps are Horovod's average
    under its own ``Compression.fp16``; with ``"int8"`` and ``"int6"`` the average of their
    EXACT_CODES, computed apart; the compressor's warm-up steps are Horovod's in fp32 under all."""
    model = five_layers()
    opt, compression = adamw(model, exact_compression, schedule=schedule, profile_steps=1)
    reports = []
    try:
        for step in range(STEPS):
            if step == 10:   # exact on the schedule, after the warm-ups
                assert compression.regime() == (
                    {"(exact)": f"exact every 4 steps (step 10 exact), out of band in {exact_compression[3:]} bits "
                                f"({EXACT_CODES[exact_compression]})"}
                    if exact_compression in EXACT_CODES else
                    {"horovod": "exact every 4 steps (step 10 exact), on Horovod's "
                                f"allreduce{' in fp16' if exact_compression == 'fp16' else ''}"})
            local = local_gradients(model, step)
            reduced = train_step(model, opt, step)
            reports.append(compression.exact_report)
            if exact_compression in EXACT_CODES and step >= WARMUP and expected_exact(step):
                exact_average = out_of_band_average(local, comm, exact_compression)
            else:
                wire = hvd.Compression.fp16 if exact_compression == "fp16" and step >= WARMUP else hvd.Compression.none
                exact_average = {name: hvd.allreduce(torch.from_numpy(g), name=f"check.{name}",
                                                     compression=wire).numpy() for name, g in local.items()}
            same = all(np.array_equal(reduced[name], exact_average[name]) for name in local)
            assert same == expected_exact(step), f"step {step}: exact average {same}, expected {expected_exact(step)}"
    finally:
        compression.close()  # a planned schedule's channel threads end, and Python's switch interval is restored
    assert reports == [(step, expected_exact(step)) for step in range(STEPS)]
    assert_identical_across_ranks(np.array([exact for _, exact in reports]))
    exact_count = sum(map(expected_exact, range(STEPS)))   # 13 of 30
    assert counters(opt, compression) == (STEPS, STEPS, STEPS + 1, exact_count + 1)  # + broadcast's step
    assert np.isfinite(flat(model)).all()
    assert_identical_across_ranks(flat(model))


def scaled_step(model, opt, scaler, step, poisoned):
    """One step under a real GradScaler (fp16 autocast on the CPU); on ``poisoned`` steps rank
    (step % P) feeds an inf. Returns whether the scaler stepped, the same on every rank."""
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_of(model, step)
        if step in poisoned and hvd.rank() == step % hvd.size():
            loss = loss * float("inf")
    skipped = grad_scaler_step(opt, scaler, loss)
    stepped = allgather_int64(communicator_of(None), [int(not skipped)])[:, 0]
    assert len(set(stepped.tolist())) == 1, f"ranks disagree on the overflow: {stepped}"
    return bool(stepped[0])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exact_compression", ["none", "int8"])  # int8: an exact step out of band overflows
def test_an_overflowed_step_moves_no_counter(exact_compression, assert_identical_across_ranks):
    """Poisoned on a compressed step (5) and on an exact one (6): both are skipped, no counter
    moves, the schedule goes on where it was, training goes on."""
    model = five_layers()
    opt, compression = adamw(model, exact_compression)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=1000)
    poisoned, taken = (5, 6), 0
    for step in range(12):
        before = counters(opt, compression)
        stepped = scaled_step(model, opt, scaler, step, poisoned)
        assert stepped == (step not in poisoned), step
        if stepped:
            assert compression.exact_report == (taken, expected_exact(taken))
            taken += 1
        else:
            assert counters(opt, compression) == before, f"step {step} overflowed but a counter moved"
    assert counters(opt, compression)[:2] == (taken, taken) == (10, 10)
    assert np.isfinite(flat(model)).all()
    assert_identical_across_ranks(flat(model))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("exact_compression", ["none", "int8"])  # int8: its exact steps' bucket keeps no state
def test_a_checkpoint_before_a_variance_refresh_resumes_bit_for_bit(exact_compression, assert_identical_across_ranks):
    """Saved after step 8 (step 9 compressed, 10 exact): the resumed run's steps 9-12 give the
    same parameters as the run that went on."""
    model = five_layers()
    opt, compression = adamw(model, exact_compression)
    for step in range(9):
        train_step(model, opt, step)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()), gather_state(compression))
    for step in range(9, 13):
        train_step(model, opt, step)

    resumed_model = five_layers()
    # its broadcast step decays the weights: load after
    resumed, resumed_compression = adamw(resumed_model, exact_compression)
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    scatter_state(resumed_compression, saved[2] if hvd.rank() == 0 else None)
    for step in range(9, 13):
        train_step(resumed_model, resumed, step)
    assert np.array_equal(flat(resumed_model), flat(model))
    assert counters(resumed, resumed_compression) == counters(opt, compression)
    assert_identical_across_ranks(flat(resumed_model))


@pytest.mark.timeout(120)
def test_ranks_with_different_schedules_fail_together_naming_them():
    """One rank's AdamW refreshes its variance on other steps than the rest: every rank raises a
    ValueError naming the schedules at the first gradient, before Horovod's first allreduce
    (which would otherwise fail on mismatched shapes, a gradient on one rank and a probe on another)."""
    model = five_layers()
    compression = hvds.Compression.from_spec(SPEC, dense_below=0)
    opt = hvd.DistributedOptimizer(hvds.AdamW(model.parameters(), lr=1e-2, exact_warmup=3 + hvd.rank(), max_interval=4),
                                   named_parameters=model.named_parameters(), compression=compression)
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"different exact-step schedules .*rank 0: exact steps ExactSteps\(warmup=3, "
                                         r"max_interval=4, compression='none'\); rank 1: exact steps "
                                         r"ExactSteps\(warmup=4"):
        loss_of(model, 0).backward()
    assert not opt._handles, "an allreduce was started before the check"
