"""The PyTorch out-of-band compressor: one fused exchange per step, behind the stock
``hvd.DistributedOptimizer``, for the compressors Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT).

Horovod calls ``compress`` for every gradient of a step (from the backward hooks and
``synchronize()``) before the step's first ``decompress``. So:

1. ``compress`` records the gradient under its parameter's name (read from the calling
   Horovod code; its position in the step where no name is visible) and hands Horovod a
   one-element probe (its reduced value gives the Average/Sum scale,
   :mod:`horovod_sparse.sparse_adapter`);
2. the step's first ``decompress`` runs the pipeline on the recorded gradients, ordered by
   name (Horovod compresses the gradients missing from the backward pass in
   ``synchronize()``, in an order that differs between steps and ranks), as one buffer: a
   sparsifier gets them as pieces of it (its memory reads them in place: grad + residual
   in one pass), the other pipelines a copy in one persistent float32 buffer on their
   device (:class:`FusedBuffer`). One exchange per step, on the ranks of the optimizer's
   process set; the ranks first agree on the layout (one 8-byte Allgather), so ranks
   whose gradients differ fail together with a clear error;
3. each ``decompress`` writes its gradient's part of the sum into the gradient tensor
   itself (zeroed, then the summed pairs scattered in for sparsifiers; copied from the
   dense sum for the others), scaled by its probe, and returns it - in place, as
   Horovod's own allreduce does. Only the pipeline's payload ever leaves the device.

A frozen parameter (``requires_grad`` False, as in fine-tuning schedules) leaves the fused
layout at the step it is frozen on every rank: its residual is kept aside, untouched, and
restored when it is unfrozen (:mod:`horovod_sparse.regroup`), never drained into a frozen
parameter. Horovod still reduces its gradient, which it zero-fills: it gets a probe like
the others (so Horovod's payloads never differ across ranks, whatever a rank froze) and a
zero result; a non-zero gradient on a frozen parameter is refused on every rank.

With a ``schedule`` other than ``"after_backward"`` (docs/scheduling.md), the first
``profile_steps`` steps run as above while the arrivals of the gradients are timed; then
the exchange's cost is fitted on its own path, a plan is made on rank 0 and broadcast
(:mod:`horovod_sparse.torch.profiling`, :func:`horovod_sparse.schedule.choose_plan`), and
from the next step on each planned bucket is exchanged on a channel thread as soon as its
gradients are in, while backward goes on (:mod:`horovod_sparse.torch.channels`); its
``decompress`` waits for it.
"""
import logging
import statistics
import time

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from horovod_sparse.checks import check_choice, check_positive_int
from horovod_sparse.horovod_checks import caller_gradient, caller_process_set, check_caller, communicator_of
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.regroup import PIPELINE_KEY
from horovod_sparse.schedule.planner import PLANNED, SCHEDULES, channels_of, choose_plan
from horovod_sparse.sparse_adapter import SparseCompressorBase
from horovod_sparse.torch.buckets import Bucket, FusedBuffer, StepSum, key_order  # noqa: F401  (re-exported)
from horovod_sparse.torch.channels import BucketPlan, ChannelExchanges, open_channels
from horovod_sparse.torch.profiling import ArrivalTrace, fit_exchange_cost
from horovod_sparse.torch.trials import PlanTrials, candidates

FUSED_KEY = "fused"
log = logging.getLogger("horovod_sparse.schedule")


class TorchOutOfBandCompressor(SparseCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` that exchanges the fused step out of band.

    Args:
        algorithm: a fused compressor (``horovod_sparse.create("topk:density=0.01")``).
        dense_below: gradients with fewer elements (and non-float ones) go through Horovod's
            allreduce unchanged.
        schedule: when the exchanges run: ``"after_backward"`` (default: one exchange of
            the whole step after backward), ``"wfbp"`` (one per gradient, each as soon as it
            is ready), ``"mgwfbp"`` (MG-WFBP's greedy merge), ``"optimal"`` (the exact
            dynamic program), ``"asc"`` (merged buckets on two simultaneous channels) or
            ``"auto"`` (every distinct plan of those, the simulator's pick first, run for
            1 + ``trial_steps`` steps each; the one measured fastest is kept).
        profile_steps: steps run after backward, timed, before a schedule's plan is made
            (integer >= 1, default 3; the first is left out of the trace as warm-up).
        trial_steps: with ``"auto"``, timed steps each candidate plan runs (after one
            warm-up step) before the fastest is kept (integer >= 1, default 5; each
            candidate's median step period counts).

    The fused buffer is float32 on the gradients' device; results are written back in each
    gradient's own dtype and device. Use one instance per optimizer (with ``process_set=``,
    the exchange runs among that set's ranks). ``state_dict()`` is keyed by parameter name
    (and holds the schedule's plan, so that a resumed run exchanges the same buckets).
    ``schedule_report`` says, once planned, what was measured and chosen.

    Example::

        compression = TorchOutOfBandCompressor(horovod_sparse.create("topk", density=0.01), schedule="auto")
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
    """

    ops = TorchOps()

    def __init__(self, algorithm, dense_below=None, schedule="after_backward", profile_steps=3, trial_steps=5):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self.schedule = check_choice("schedule", schedule, SCHEDULES)
        self.profile_steps = check_positive_int("profile_steps", profile_steps)
        self.trial_steps = check_positive_int("trial_steps", trial_steps)
        # this step's gradients, as compress hands them over
        self._position = 0
        self._step_finished = False
        self._trial_start = None    # perf_counter at the first compress of the step "auto" is trying
        self._recorded = {}    # key -> gradient, this step
        self._frozen = {}      # key -> gradient of a frozen parameter, this step
        self._results = None   # the step's sum (StepSum or ChannelExchanges), after its exchange
        self._caller_checked = False
        # the exchanges: one bucket after backward until a plan exists, then the plan's channels
        self._whole_step = Bucket(algorithm)
        self._channels = None       # ChannelExchanges, once planned
        self._trace = ArrivalTrace()  # gradient arrivals of the profiled steps
        self._trials = None         # PlanTrials, while "auto" runs its candidate plans
        self._loaded_plan = None    # (BucketPlan, whole-buffer states) from a checkpoint, until the next step
        self.schedule_report = None

    def compress(self, tensor):
        if self._step_finished:
            self._position, self._step_finished = 0, False
            self._recorded, self._frozen, self._results = {}, {}, None
            if self._trials is not None:  # the step before has ended: its period is known
                now = time.perf_counter()
                if self._trial_start is not None:
                    self._trials.record(now - self._trial_start)
                self._trial_start = now
            if self._channels is not None:
                self._channels.start_step()
        if not self._caller_checked:
            check_caller(self.algorithm.name, hvd.Adasum, _DistributedAdasumOptimizer._allreduce_grad_async.__code__,
                         process_sets=True)
            self._comm = communicator_of(caller_process_set())
            self._caller_checked = True
        if self._loaded_plan is not None:  # a resumed run: every rank loaded its plan, and calls this
            self._adopt(*self._loaded_plan)
        name, parameter = caller_gradient(tensor)
        key = self._position if name is None else name
        self._position += 1
        if self.goes_dense(tensor):
            return self.compress_dense(tensor, key)
        if key in self._recorded or key in self._frozen:
            raise ValueError(f"{self.algorithm.name}: gradient {key!r} was compressed twice in one step "
                             "(one compressor instance per optimizer, one name per tensor)")
        frozen = parameter is not None and not parameter.requires_grad
        (self._frozen if frozen else self._recorded)[key] = tensor
        if self._channels is not None:
            self._channels.arrived(key, self._recorded, self._frozen)
        elif self.schedule != "after_backward":
            self._trace.arrived(key)
        probe = torch.ones(1, dtype=torch.float32, device=tensor.device)
        self.record(key, tensor, probe)
        return probe, ("sparse", key)

    def decompress(self, tensor, ctx):
        self._step_finished = True
        if ctx is None:  # a sparse gradient (nn.Embedding(sparse=True)) Horovod allgathered
            return tensor
        kind, info = ctx
        if kind == "dense":
            return self.decompress_dense(tensor, info)
        if self._results is None:
            self._results = self._exchange()
        return self._results.write(info, self.scale(tensor.item()))

    def _exchange(self):
        """The step's exchanges: wait for the planned buckets, or exchange the whole step now
        (and, once enough steps are profiled, plan)."""
        if self._channels is not None:
            results = self._channels.finish(self._recorded, self._frozen)
            self.sparsifiers = self._channels.pipelines()
            if self._trials is not None and (self._trials.finished or self._trials.step_ran()):
                self._next_trial()  # from the next step on; this step's sums stay with the exchanges that made them
            return results
        if self.schedule != "after_backward":
            self._trace.end_step()
        results = self._whole_step.exchange(self._recorded, self._frozen, self.comm, self.algorithm.name)
        if self._whole_step.pipeline is not None:
            self.sparsifiers = {FUSED_KEY: (self._whole_step.layout, self._whole_step.pipeline)}
        if self.schedule != "after_backward":
            if len(self._trace.steps) >= self.profile_steps and self._recorded:
                self._plan()
        return results

    # -- planning ----------------------------------------------------------------------
    def _plan(self):
        """Fit, plan on rank 0, broadcast, switch (collective: every rank, the same step)."""
        known = sorted(self._recorded, key=key_order)  # the same on every rank (its layout was just agreed)
        order, compute, tail = self._trace.backward_trace(known)
        channels = open_channels(self.comm, channels_of(self.schedule))
        report = {"schedule": self.schedule, "profiled_steps": len(self._trace.steps)}
        fit = None
        if self.schedule not in ("after_backward", "wfbp"):  # the others weigh start-ups against bytes
            fit = fit_exchange_cost(self.algorithm, order, self._recorded, channels, self.algorithm.name)
            report.update(fit_a_s=fit["cost"].a, fit_b_s_per_byte=fit["cost"].b, fit_r2=fit["r2"],
                          fit_points=fit["points"], simultaneity=fit["simultaneity"])
        plans = None
        if self.comm.Get_rank() == 0:
            sizes = [4 * self._recorded[k].numel() for k in order]
            if fit is None:
                choice = choose_plan(self.schedule, compute, sizes, cost=lambda nbytes: 0.0)
            else:
                # k2 below 1 (two at once faster than one alone) is noise: the channels share one link
                extra = {} if fit["simultaneity"] is None else {"simultaneity": max(1.0, fit["simultaneity"])}
                choice = choose_plan(self.schedule, compute, sizes, fit["cost"], tail_s=tail, **extra)
            plans = (candidates(choice, order) if self.schedule == "auto"
                     else [(choice.schedule, BucketPlan.from_ranges(choice.plan, order))])
            report.update(predicted_s=choice.predicted, backward_s=sum(compute) + tail)
        plans = self._broadcast_plans(plans, known)
        name, plan = plans[0]
        report.update(running=name, buckets=[list(keys) for keys in plan.keys], channels=list(plan.channels))
        if len(plans) > 1:
            self._trials = PlanTrials(plans, self.trial_steps)
            report.update(chosen=None, trials=[{"schedule": n, "buckets": len(p.keys), "channels": p.channel_count,
                                                "measured_s": None} for n, p in plans])
        else:
            report.update(chosen=name)
        self.schedule_report = report
        if self.comm.Get_rank() == 0:
            log.info("horovod_sparse %s schedule=%s: %s", self.algorithm.name, self.schedule, report)
        slices = self._whole_step.pipelines.state_dict()
        whole = slices.pop(PIPELINE_KEY, None)  # its step counter carries over to every bucket
        self._adopt(plan, [whole] * len(plan.keys), slices=slices, channels=channels)

    def _broadcast_plans(self, plans, known):
        """Rank 0's ``[(schedule name, BucketPlan)]`` on every rank (the others pass None)."""
        names = np.array([] if plans is None else [PLANNED.index(n) for n, _ in plans], dtype=np.int64)
        count = np.array([names.size], dtype=np.int64)
        self.comm.Bcast(count, root=0)
        if plans is None:
            names = np.empty(int(count[0]), dtype=np.int64)
        self.comm.Bcast(names, root=0)
        return [(PLANNED[int(n)], BucketPlan.broadcast(None if plans is None else plans[i][1], self.comm, known))
                for i, n in enumerate(names)]

    def _next_trial(self):
        """``"auto"``'s current candidate has run its steps: run the next one, or keep the
        fastest measured (collective: every rank, the same step, the same choice)."""
        trials, report = self._trials, self.schedule_report
        if trials.finished:
            following, timed = trials.decide(self.comm)  # the fastest
            for row, steps in zip(report["trials"], timed):
                row.update(measured_s=statistics.median(steps), steps_s=steps)
            self._trials = self._trial_start = None
        else:
            following = trials.index  # the next candidate
        name, plan = trials.candidates[following]
        report.update(running=name, buckets=[list(keys) for keys in plan.keys], channels=list(plan.channels))
        if self._trials is None:
            report["chosen"] = name
            if self.comm.Get_rank() == 0:
                log.info("horovod_sparse %s schedule=auto kept %s: %s", self.algorithm.name, name, report["trials"])
        started = time.perf_counter()
        if plan != self._channels.plan:
            self._switch(plan)
        if self._trial_start is not None:  # the switch is no part of the step's period
            self._trial_start += time.perf_counter() - started

    def _switch(self, plan):
        """Exchange by ``plan`` from the next step on: each gradient keeps its residual; a
        bucket of the same gradients as before keeps all its state, the others its step counter."""
        slices, wholes = self._channels.state_dict()
        old = dict(zip(self._channels.plan.keys, wholes))
        step = {"step": step_of(wholes)}
        self._adopt(plan, [old.get(keys) or step for keys in plan.keys], slices=slices)

    def _adopt(self, plan, wholes, slices=None, channels=None):
        """Exchange by ``plan`` from the next step on; the buckets take the gradients' state."""
        if slices is None:
            slices = {k: v for k, v in self._whole_step.pipelines.kept.items()}
        self._loaded_plan = None
        if self._channels is not None:  # a checkpoint's plan replaces the current one
            self._channels.close()
        if channels is None:
            channels = open_channels(self.comm, plan.channel_count)
        self._channels = ChannelExchanges(self.algorithm, plan, self.comm, self.algorithm.name, channels)
        self._channels.load_state_dict(slices, wholes)
        self._whole_step.close()

    def last_step_timeline(self):
        """With a plan: when the last step's gradients arrived and its buckets were exchanged
        (:meth:`~horovod_sparse.torch.channels.ChannelExchanges.timeline`); None before."""
        return None if self._channels is None else self._channels.timeline()

    # -- checkpointing: by gradient key, so that state follows its parameter ------------
    def state_dict(self):
        """``{parameter name: {field: its slice of the residual...}}`` plus the pipelines'
        whole-buffer state under ``"(fused)"`` (numpy arrays and ints; with a plan, its
        buckets and each bucket's state); each rank saves its own."""
        if self._channels is None:
            return self._whole_step.pipelines.state_dict()
        slices, wholes = self._channels.state_dict()
        plan = self._channels.plan
        return {**slices, PIPELINE_KEY: {"step": step_of(wholes), "buckets": wholes[:len(plan.keys)],
                                         "plan": {"keys": [list(k) for k in plan.keys],
                                                  "channels": list(plan.channels),
                                                  "settled": self._trials is None}}}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`, now or at the first step; a gradient's state goes back to
        it by name, whatever the layout then. A saved plan is resumed if this compressor has a
        schedule (not ``"after_backward"``); one saved while ``"auto"`` was still trying its
        candidates is not: the residuals are, and the resumed run profiles and tries again."""
        whole = state_dict.get(PIPELINE_KEY) or {}
        if "plan" in whole and whole["plan"].get("settled", True) and self.schedule != "after_backward":
            plan = BucketPlan(tuple(tuple(k) for k in whole["plan"]["keys"]), tuple(whole["plan"]["channels"]))
            slices = {k: v for k, v in state_dict.items() if k != PIPELINE_KEY}
            self._trials = self._trial_start = None  # a settled plan: auto does not go on trying
            if self._channels is not None and self._channels.plan == plan:
                self._channels.load_state_dict(slices, whole["buckets"])
            else:  # planned at the next compress, where the communicator is known
                self._whole_step.pipelines.kept.update(slices)
                self._loaded_plan = (plan, list(whole["buckets"]))
            return
        if self._channels is not None:  # saved without a plan: residuals by name, the step counter
            slices = {k: v for k, v in state_dict.items() if k != PIPELINE_KEY}
            self._channels.load_state_dict(slices, [whole or None] * len(self._channels.plan.keys))
            return
        self._whole_step.pipelines.load_state_dict(state_dict)

    def close(self):
        if self._channels is not None:
            self._channels.close()
        self._whole_step.close()


def step_of(wholes):
    """The step counter of a plan's buckets (each bucket's whole-buffer state, or None)."""
    return max((w["step"] for w in wholes if w is not None and "step" in w), default=0)


#: the name it had when only sparsifiers used it
TorchSparseCompressor = TorchOutOfBandCompressor
