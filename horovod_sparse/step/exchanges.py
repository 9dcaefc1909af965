"""When and in which buckets a step's out-of-band gradients are exchanged: the schedule.

:class:`StepExchanges` is what the out-of-band compressors (PyTorch's
:class:`~horovod_sparse.torch.out_of_band.TorchOutOfBandCompressor`, TensorFlow's
:class:`~horovod_sparse.tensorflow.out_of_band.TFOutOfBandCompressor`) hand a step's gradients to (``arrived`` as ``compress`` records them, ``finish`` at the
step's first ``decompress``). With ``schedule="after_backward"`` that is one
:class:`~horovod_sparse.step.bucket.Bucket` of the whole step, exchanged in ``finish``.
With another schedule (docs/results/scheduling.md):

1. the first ``profile_steps`` steps run the same way while the gradients' arrivals are
   timed (:class:`~horovod_sparse.schedule.arrivals.ArrivalTrace`);
2. then the exchange's cost is fitted on its own path, a plan is made on rank 0
   (:func:`horovod_sparse.schedule.choose_plan`) and broadcast as int64;
3. from the next step on each planned bucket is exchanged on a channel thread as soon as
   its gradients are in, while backward goes on (:mod:`horovod_sparse.step.channels`);
4. ``"auto"`` runs each distinct plan for a few steps and keeps the fastest measured
   (:mod:`horovod_sparse.step.trials`); every switch keeps each gradient's residual.

``state_dict`` holds the gradients' state by key and, once planned, the plan: numbers and
strings only (:mod:`horovod_sparse.state_format`), so a rank-0 checkpoint resumes it.
"""
import logging
import statistics
import time

import numpy as np

from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.schedule.planner import PLANNED, channels_of, choose_plan
from horovod_sparse.schedule.arrivals import ArrivalTrace
from horovod_sparse.step.bucket import Bucket, key_order
from horovod_sparse.step.channels import BucketPlan, ChannelExchanges, open_channels
from horovod_sparse.step.profiling import fit_exchange_cost
from horovod_sparse.step.trials import PlanTrials, candidates

#: ``pipelines`` key of the whole step's pipeline (before a plan, or without a schedule)
WHOLE_STEP_KEY = "whole_step"
log = logging.getLogger("horovod_sparse.schedule")


class StepExchanges:
    """A step's exchanges for one optimizer, as ``schedule`` says.

    Attributes:
        report: once planned, what was measured and chosen (the compressor's ``schedule_report``).
        pipelines: ``{name: (GradientLayout, pipeline)}`` of the last step's exchanges (accounting).

    Example (what the compressor does each step)::

        exchanges = StepExchanges(horovod_sparse.create("topk", density=0.01), TORCH_ARRAYS, "mgwfbp")
        exchanges.start_step(comm)
        exchanges.arrived("fc.weight", recorded, frozen)   # from compress, as gradients come
        sums = exchanges.finish(recorded, frozen)          # at the first decompress
        sums.write("fc.weight", scale=0.5)
    """

    def __init__(self, algorithm, arrays, schedule="after_backward", profile_steps=3, trial_steps=5):
        self.algorithm, self.arrays, self.schedule = algorithm, arrays, schedule
        self.profile_steps, self.trial_steps = profile_steps, trial_steps
        self.comm = None            # the optimizer's process set's communicator, from the first step
        self.report = None
        self.pipelines = {}
        # one bucket after backward until a plan exists, then the plan's channels
        self._whole_step = Bucket(algorithm, arrays)
        self._channels = None       # ChannelExchanges, once planned
        self._trace = ArrivalTrace()  # gradient arrivals of the profiled steps
        # "auto": the candidate plans while it tries them, and when the step being timed began
        self._trials = None
        self._trial_start = None
        self._loaded_plan = None    # (BucketPlan, whole-buffer states) from a checkpoint, until the next step

    def start_step(self, comm):
        """A new step begins (its first ``compress``), on ``comm``."""
        self.comm = comm
        if self._trials is not None:  # the step before has ended: its period is known
            now = time.perf_counter()
            if self._trial_start is not None:
                self._trials.record(now - self._trial_start)
            self._trial_start = now
        if self._loaded_plan is not None:  # a resumed run: every rank loaded its plan, and calls this
            self._adopt(*self._loaded_plan)
        if self._channels is not None:
            self._channels.start_step()

    def arrived(self, key, recorded, frozen):
        """``key`` was just added to this step's ``recorded`` (or ``frozen``) gradients."""
        if self._channels is not None:
            self._channels.arrived(key, recorded, frozen)
        elif self.schedule != "after_backward":
            self._trace.arrived(key)

    def finish(self, recorded, frozen, finite=True):
        """The step's sums (``write(key, scale)``): wait for the planned buckets, or exchange
        the whole step now (and, once enough steps are profiled, plan). Collective.
        ``finite=False``: another gradient of this rank's step (one Horovod carries) overflowed,
        so the whole step's exchange is skipped on every rank; planned buckets have gone out
        before it is known, each checking only its own gradients."""
        if self._channels is not None:
            try:
                results = self._channels.finish(recorded, frozen)
            except NonFiniteGradientError:  # an overflowed step is no trial step: its period is not kept
                self._trial_start = None
                raise
            self.pipelines = self._channels.pipelines()
            if self._trials is not None and (self._trials.finished or self._trials.step_ran()):
                self._next_trial()  # from the next step on; this step's sums stay with the exchanges that made them
            return results
        backward_end = time.perf_counter()
        try:
            results = self._whole_step.exchange(recorded, frozen, self.comm, self.algorithm.name, finite)
        except NonFiniteGradientError:  # nor a profiled step: its arrivals are not kept
            self._trace.discard_step()
            raise
        if self.schedule != "after_backward":
            self._trace.end_step(at=backward_end)
        if self._whole_step.pipeline is not None:
            self.pipelines = {WHOLE_STEP_KEY: (self._whole_step.layout, self._whole_step.pipeline)}
        if self.schedule != "after_backward":
            if len(self._trace.steps) >= self.profile_steps and recorded:
                self._plan(recorded)
        return results

    # -- planning ----------------------------------------------------------------------
    def _plan(self, recorded):
        """Fit, plan on rank 0, broadcast, switch (collective: every rank, the same step)."""
        known = sorted(recorded, key=key_order)  # the same on every rank (its layout was just agreed)
        order, compute, tail = self._trace.backward_trace(known)
        channels = open_channels(self.comm, channels_of(self.schedule))
        report = {"schedule": self.schedule, "profiled_steps": len(self._trace.steps)}
        fit = None
        if self.schedule not in ("after_backward", "wfbp"):  # the others weigh start-ups against bytes
            fit = fit_exchange_cost(self.algorithm, self.arrays, order, recorded, channels, self.algorithm.name)
            report.update(fit_a_s=fit["cost"].a, fit_b_s_per_byte=fit["cost"].b, fit_r2=fit["r2"],
                          fit_points=fit["points"], simultaneity=fit["simultaneity"])
        plans = None
        if self.comm.Get_rank() == 0:
            sizes = [4 * self.arrays.numel(recorded[k]) for k in order]
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
        self.report = report
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
        trials, report = self._trials, self.report
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
        self._channels = ChannelExchanges(self.algorithm, plan, self.comm, self.algorithm.name, channels, self.arrays)
        self._channels.load_state_dict(slices, wholes)
        self._whole_step.close()

    def timeline(self):
        """With a plan: when the last step's gradients arrived and its buckets were exchanged
        (:meth:`~horovod_sparse.step.channels.ChannelExchanges.timeline`); None before."""
        return None if self._channels is None else self._channels.timeline()

    # -- state: by gradient key, so that state follows its parameter -------------------
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

