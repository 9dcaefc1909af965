"""``Compression.auto()`` behind the stock hvd.DistributedOptimizer, at P = 2 and 3.

Every step equals an oracle that applies the plan in effect per gradient: Horovod's fp32
average (an MPI Allreduce in float64), fp16's average (within fp16's rounding), and per
out-of-band candidate a numpy pipeline over its gradients in key order, fed this rank's local
gradients. The oracle keeps its own books of what a change of plan does: a gradient leaving a
candidate takes its residual along into its next gradient; the candidate's pipeline is remade
for the gradients that stay, with their residuals and the step counter. Through profiling,
trials, settling, the guard and a re-plan on drift: the choice is the same on every rank, the
replicas end bitwise identical, a checkpoint resumes bit for bit, and ranks that disagree fail
together.
"""
import copy
import time

import horovod.torch as hvd
import numpy as np
import pytest
import torch

import horovod_sparse
import horovod_sparse.torch as hvds
from horovod_sparse import checkpoint
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import cut, per_element_fields

from test_schedules import distributed, five_layers, flat, local_gradients, loss_of, train_step

DENSE_BELOW = 100  # the weights (1600 elements) can be compressed, the biases (40) stay dense
CANDIDATES = ("fp16", "topk:density=0.05", "oktopk:density=0.05")


def auto(**kwargs):
    # every shortlisted plan is tried (no pruning), two steps each: the tests see it settle
    kwargs = {"candidates": CANDIDATES, "dense_below": DENSE_BELOW, "profile_steps": 2, "trial_steps": 1,
              "prune": 1e9, "max_trials": 4, "check_every": 1000, **kwargs}
    return hvds.Compression.auto(**kwargs)


class PlanOracle:
    """numpy pipelines per out-of-band choice, and the residuals left behind by changes of plan."""

    def __init__(self, comm, shapes):
        self.comm, self.shapes = comm, shapes
        self.pipelines = {}  # choice -> (layout, numpy pipeline)
        self.steps = {}      # choice -> step counter of its pipeline, while no gradient has that choice
        self.drain = {}      # name -> residual to add to its next gradient
        self.plan = {}

    def follow(self, plan):
        """The plan of the coming step: remake the pipelines whose gradients change."""
        for choice, (layout, reference) in list(self.pipelines.items()):
            keys = [e.key for e in layout.entries]
            staying = [k for k in keys if plan.get(k) == choice]
            if staying == keys:
                continue
            slices, whole = cut(layout, reference.state_dict())
            reference.close()
            del self.pipelines[choice]
            for k in set(keys) - set(staying):
                residual = slices[k].get("memory_residual", slices[k].get("residual"))
                self.drain[k] = residual.copy()
            if staying:
                self.pipelines[choice] = self._make(choice, staying, {k: slices[k] for k in staying}, whole["step"])
            else:  # the step counter waits for the choice's next gradients
                self.steps[choice] = whole["step"]
        for choice in sorted(set(plan.values()) - {"none", "fp16"}):
            if choice not in self.pipelines:
                self.pipelines[choice] = self._make(choice, [k for k in plan if plan[k] == choice], {},
                                                    self.steps.pop(choice, None))
        self.plan = dict(plan)

    def _make(self, choice, keys, slices, step):
        layout = GradientLayout([(k, self.shapes[k], "float32") for k in sorted(keys)])
        reference = horovod_sparse.create(choice).make_pipeline(layout.n, self.comm, layout=layout)
        state = reference.state_dict()
        for field in per_element_fields(state, layout.n):
            state[field] = np.concatenate([slices[e.key][field] if e.key in slices
                                           else np.zeros(e.size, np.float32) for e in layout.entries])
        if step is not None:
            state["step"] = step
        reference.load_state_dict(state)
        return layout, reference

    def check(self, reduced, grads):
        grads = {k: g + self.drain.pop(k).reshape(g.shape) if k in self.drain else g for k, g in grads.items()}
        size = self.comm.Get_size()
        for name, choice in self.plan.items():
            if choice in ("none", "fp16"):
                local = grads[name].astype(np.float16).astype(np.float64) if choice == "fp16" else grads[name]
                total = np.empty(local.shape, np.float64)
                self.comm.Allreduce(np.asarray(local, np.float64), total)
                tolerance = dict(rtol=2e-3, atol=2e-4) if choice == "fp16" else dict(rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(reduced[name], total / size, err_msg=f"{name} ({choice})", **tolerance)
        for choice, (layout, reference) in self.pipelines.items():
            summed = np.asarray(reference.step(layout.fuse([grads[e.key] for e in layout.entries]), tag=layout.tag))
            for e, want in zip(layout.entries, layout.split(summed / np.float32(size))):
                np.testing.assert_allclose(reduced[e.key], want, rtol=1e-5, atol=1e-6, err_msg=f"{e.key} ({choice})")

    def close(self):
        for _, reference in self.pipelines.values():
            reference.close()


def first_plan(model):
    """What auto runs while profiling: the first out-of-band candidate from dense_below up."""
    return {name: CANDIDATES[1] if p.numel() >= DENSE_BELOW else "none" for name, p in model.named_parameters()}


@pytest.mark.timeout(240)
def test_every_step_equals_the_plan_oracle_through_trials_the_guard_and_a_replan(comm, assert_identical_across_ranks,
                                                                               assert_same_text_across_ranks):
    model, compression = five_layers(), auto(check_every=3, drift=2.0)
    opt = distributed(model, compression)
    oracle = PlanOracle(comm, {name: tuple(p.shape) for name, p in model.named_parameters()})
    start, report = flat(model).copy(), compression.auto_report
    plans_seen, phases = [], []
    try:
        oracle.follow(first_plan(model))
        step = 0

        def run(steps, sleep=0.0):
            nonlocal step
            for _ in range(steps):
                grads = local_gradients(model, step)
                time.sleep(sleep)
                oracle.check(train_step(model, opt, step), grads)
                oracle.follow(compression.plan)
                plans_seen.append(dict(compression.plan))
                phases.append(compression.phase)
                step += 1

        run(2)  # profiled: the shortlist is made at the end of step 1
        assert compression.phase == "trying" and 2 <= len(report["trials"]) <= 4
        assert [t["measured_s"] for t in report["trials"]] == [None] * len(report["trials"])
        run(2 * len(report["trials"]) + 1)  # a warm-up and a timed step each, and one more
        assert compression.phase == "settled" and report["chosen"] in [t["plan"] for t in report["trials"]]
        assert all(t["measured_s"] > 0 and len(t["steps_s"]) == 1 for t in report["trials"])
        assert report["chosen"] == min(report["trials"], key=lambda t: t["measured_s"])["plan"]
        assert len({tuple(sorted(p.items())) for p in plans_seen}) >= 2, "the trials ran distinct plans"
        assert_same_text_across_ranks(sorted(compression.plan.items()))

        # the guard: a bound no residual meets moves every error-feedback gradient to fp16,
        # its residual into its next gradient (the oracle checks that nothing is lost)
        compression.max_residual_ratio = 1e-12
        compressed = sorted(k for k, c in compression.plan.items() if c not in ("none", "fp16"))
        run(3, sleep=0.05)  # from here on steps of 0.05 s and more: a steady time for the drift check
        if compressed:
            assert report["guard"] and report["guard"][-1]["keys"] == compressed
            assert all(compression.plan[k] == "fp16" for k in compressed)
        compression.max_residual_ratio = 1e9
        # drift: steps ten times slower than the settled baseline (0.5 s of sleep in every step,
        # not 0.05 s) make it profile and try again
        assert not report["replans"]
        run(3, sleep=0.05)
        run(3, sleep=0.5)
        assert report["replans"] and report["replans"][-1]["window_s"] > 3 * report["replans"][-1]["baseline_s"]
        assert compression.phase in ("profiling", "trying")
        for _ in range(2 + 2 * 4 + 1):
            if compression.phase == "settled":
                break
            run(1)
        assert compression.phase == "settled"
        assert_same_text_across_ranks(sorted(compression.plan.items()))
    finally:
        oracle.close()
        compression.close()
    assert_identical_across_ranks(flat(model))
    assert not np.array_equal(flat(model), start)


def state_after(model, opt, compression, steps):
    for step in range(steps):
        train_step(model, opt, step)
    return (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
            checkpoint.gather_state(compression))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("saved_at, phase", [(3, "trying"), (12, "settled")])
def test_a_rank0_checkpoint_resumes_bit_for_bit_while_trying_and_settled(saved_at, phase,
                                                                         assert_identical_across_ranks,
                                                                         assert_resumed_like_uninterrupted, assert_same_state):
    """Train; save (gather_state on rank 0) at ``saved_at``; go on 3 steps. A new compressor
    resumed from it (scatter_state) holds every rank's state bit for bit, runs the saved plans
    (trying: the rest of the same trials, in order), and with a new model and optimizer gives
    the parameters of the uninterrupted run after the same 3 steps (bit for bit at P = 2)."""
    model, compression = five_layers(), auto()
    opt = distributed(model, compression)
    saved = state_after(model, opt, compression, saved_at)
    mine = copy.deepcopy(compression.state_dict())
    assert compression.phase == phase
    plans = []
    for step in range(saved_at, saved_at + 3):
        plans.append(dict(compression.plan))
        train_step(model, opt, step)
    compression.close()

    resumed, again = five_layers(), auto()
    resumed.load_state_dict(saved[0])
    opt = distributed(resumed, again)
    opt.load_state_dict(saved[1])
    checkpoint.scatter_state(again, saved[2] if hvd.rank() == 0 else None)
    assert again.phase == phase
    assert_same_state(again.state_dict(), mine)
    for i, step in enumerate(range(saved_at, saved_at + 3)):
        assert again.plan == plans[i]
        train_step(resumed, opt, step)
    again.close()
    assert_resumed_like_uninterrupted(flat(resumed), flat(model))
    assert_identical_across_ranks(flat(resumed))


@pytest.mark.timeout(120)
def test_ranks_with_other_auto_settings_fail_together(assert_identical_across_ranks):
    model = five_layers()
    compression = auto(trial_steps=1 + (hvd.rank() == hvd.size() - 1))
    opt = distributed(model, compression)
    with pytest.raises(ValueError, match="auto settings"):
        train_step(model, opt, 0)
    compression.close()


def test_bad_parameters_fail_at_construction():
    for kwargs, name in [({"candidates": ["topk:density=0.001"]}, "min_density"), ({"trial_steps": 0}, "trial_steps"),
                         ({"profile_steps": 1}, "profile_steps"), ({"drift": -1}, "drift"), ({"prune": 0.5}, "prune"),
                         ({"candidates": ["qsgd"]}, "error feedback"), ({"max_residual_ratio": 0}, "max_residual_ratio")]:
        with pytest.raises(ValueError, match=name):
            hvds.Compression.auto(**kwargs)
    assert isinstance(hvds.Compression.from_spec("auto:trial_steps=2"), hvds.TorchAutoCompressor)
    model = five_layers()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=hvds.Compression.auto)
    with pytest.raises(TypeError, match="without calling it"):
        loss_of(model, 0).backward()
        opt.synchronize()


@pytest.mark.timeout(120)
def test_the_guard_moves_outgrown_residuals_to_fp16_and_loses_nothing(comm, assert_identical_across_ranks):
    """A settled plan with the weights on top-k (given as a checkpoint, so that no measurement
    picks it), checked every 2 steps: under the default bound nothing moves; under a bound no
    residual meets, every top-k gradient moves to fp16 with its residual in its next gradient."""
    model, compression = five_layers(), auto(check_every=2, drift=100.0)  # no re-plan on noise
    topk = {name: CANDIDATES[1] if p.numel() >= DENSE_BELOW else "none" for name, p in model.named_parameters()}
    compression.load_state_dict({"auto": {"phase": "settled", "plan": topk, "trials": None, "chosen": "given"},
                                 "candidates": {}, "drain": {}})
    opt = distributed(model, compression)
    oracle = PlanOracle(comm, {name: tuple(p.shape) for name, p in model.named_parameters()})
    oracle.follow(topk)
    try:
        for step in range(8):
            if step == 4:
                assert compression.plan == topk and not compression.auto_report["guard"]
                compression.max_residual_ratio = 1e-12
            grads = local_gradients(model, step)
            oracle.check(train_step(model, opt, step), grads)
            oracle.follow(compression.plan)
        moved = compression.auto_report["guard"]
        assert len(moved) == 1 and moved[0]["moved_to"] == "fp16"
        assert moved[0]["keys"] == sorted(k for k, c in topk.items() if c != "none")
        assert all(r > 0 for r in moved[0]["ratios"])
        assert compression.plan == {k: "fp16" if c != "none" else c for k, c in topk.items()}
    finally:
        oracle.close()
        compression.close()
    assert_identical_across_ranks(flat(model))
