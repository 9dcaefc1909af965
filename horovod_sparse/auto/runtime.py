"""``Compression.auto`` over a run, shared by the frontends: the plan in effect, and the
phases that decide it, each switch at a step boundary on every rank.

0. **warming** (``warmup_steps``, :mod:`horovod_sparse.warmup`): every gradient goes to a dense
   choice (fp16 where it is a candidate, else none): early training is where compression
   costs the most quality, and where a fixed compressor has its own warm-up. Auto's
   candidates have none (:func:`~horovod_sparse.registry.create_steady`): this phase is theirs.
1. **profiling** (``profile_steps``): every gradient of at least ``dense_below`` elements goes
   to the first out-of-band candidate (fp16 if there is none), as a fixed compressor would,
   while the gradients' arrivals are timed (:class:`~horovod_sparse.schedule.arrivals.ArrivalTrace`).
   At its last step the frontend fits the costs on the job's ranks (:meth:`AutoRuntime.fit_costs`),
   rank 0 predicts every plan (:mod:`horovod_sparse.auto.decide`) and broadcasts the shortlist.
2. **trying**: each shortlisted plan runs one warm-up step and ``trial_steps`` timed ones; one
   ``Allreduce(MAX)`` of the periods, and every rank keeps the plan of the smallest median
   (:class:`~horovod_sparse.schedule.trials.PlanTrials`, as ``schedule="auto"`` does).
3. **settled**: every ``check_every`` steps one small ``Allreduce(MAX)`` re-checks the quality
   guard (a gradient whose residual outgrows ``max_residual_ratio`` x its gradient moves to a
   dense choice) and the step time (a window median more than ``drift`` away from the first
   one after settling profiles and tries again, keeping the plan meanwhile).

A gradient that leaves an out-of-band candidate takes its error-feedback residual along: the
frontend takes its state out of the candidate (:meth:`AutoRuntime.take_out`) and adds the
residual to its next gradient (:meth:`AutoRuntime.drained`); nothing is dropped. Other
per-element state (momentum) starts afresh. ``report`` says what was measured, predicted and
chosen, per gradient, and every re-plan.

A step whose gradient overflowed on some rank (inf or NaN: a loss scaler's overflow,
:mod:`horovod_sparse.nonfinite`) is no step: the frontend learns it on every rank at the same
point, from what the step's collectives carry anyway (the candidates' agreement headers, the
sums of Horovod's allreduce, a layout agreement), and calls :meth:`skip_step` instead of
:meth:`end_step`. Nothing of auto's changes: no arrivals are profiled, no period is timed for
a trial or the drift check, no counter moves, the guard sees nothing of it, and the residuals
drained into its gradients wait for the next step; ``report["skipped_steps"]`` counts them.

A frontend subclasses :class:`AutoRuntime`, runs each step's exchanges by :attr:`plan`, calls
:meth:`start_step` and :meth:`end_step` (or :meth:`skip_step`) around them, and implements the
four hooks.
"""
import logging
import math
import statistics
import time

import numpy as np

from horovod_sparse import registry
from horovod_sparse.agreement import check_same_on_every_rank, max_over_ranks
from horovod_sparse.auto.decide import (DEFAULT_CANDIDATES, DENSE_CHOICES, FP16, NONE, StepProfile,
                                        check_candidates, guard_violations, make_plans, shortlist)
from horovod_sparse.checks import check_bool, check_nonnegative_int, check_positive_int, check_positive_number
from horovod_sparse.layout import key_order
from horovod_sparse.nonfinite import check_nonfinite
from horovod_sparse.out_of_band import DEFAULT_DENSE_BELOW
from horovod_sparse.schedule.arrivals import ArrivalTrace
from horovod_sparse.schedule.cost import CostModel
from horovod_sparse.schedule.trials import PlanTrials
from horovod_sparse.warmup import warmup_steps as checked_warmup

log = logging.getLogger("horovod_sparse.auto")
#: per-element fields holding error feedback's residual (gradient mass not yet applied)
RESIDUAL_FIELDS = ("memory_residual", "residual")
#: optimizers whose step per coordinate comes from that coordinate's own gradient history (Adam's
#: family): error feedback hands them a coordinate's gradient in rare bursts, which they under-apply
ADAPTIVE_OPTIMIZERS = frozenset({"Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "Adadelta", "RMSprop",
                                 "SparseAdam", "Adafactor", "LAMB", "Lamb", "FusedAdam", "FusedLAMB"})
#: what sparsifiers and low rank cost under the optimizers the quality guard covers (1000 steps of
#: the transformer, warm-up included, bits per byte against dense; top-k over three seeds under AdamW and
#: two under momentum SGD, PowerSGD at seed 0; docs/results/accuracy.md)
MEASURED_COST = {"adaptive": "top-k 0.01: +5.4%, PowerSGD rank 2: +10.4% under AdamW",
                 "momentum": "top-k 0.01: +1.8%, PowerSGD rank 2: +4.2% under SGD with momentum 0.9"}
#: the fewest quantization levels a quantizer with error feedback needs to keep the recipes' quality
#: (qsgd at 127 levels, 8 bits, ended level with dense after 1000 steps under AdamW and momentum SGD)
GUARD_MIN_LEVELS = 127
#: int4 as measured: 4 bits over buckets of at most 128 values with error feedback ended within 1% of
#: dense after 1000 steps under AdamW (three seeds, +0.23% on average) and level with it under momentum
#: SGD (the transformer, ResNet-18 on the cluttered digits); at 3 bits +0.9%, at 2 bits +7.2%, over
#: buckets of 512 +1.2% (one seed each: kept out)
GUARD_INT4 = {"bits": 4, "max_bucket_size": 128}
#: default bound of the quality guard: residual norm / gradient norm (measured in docs/results/auto.md:
#: top-k at 0.01 stays under 19 on both workloads, PowerSGD at rank 2 on ResNet-18 passes 30)
DEFAULT_MAX_RESIDUAL_RATIO = 30.0


def keeps_recipe_quality(spec):
    """Whether candidate ``spec`` ends within 1% of dense under AdamW and momentum SGD, as measured:
    the dense choices, quantizers with error feedback at :data:`GUARD_MIN_LEVELS` levels or more
    (``"qsgd:levels=127,error_feedback=true"``), and ``int4`` at 4 bits over buckets of at most
    128 values with error feedback (:data:`GUARD_INT4`).

    >>> [keeps_recipe_quality(s) for s in ("fp16", "topk:density=0.01", "qsgd:levels=127,error_feedback=true",
    ...                                    "int4", "int4:bits=3")]
    [True, False, True, True, False]
    """
    if spec in DENSE_CHOICES:
        return True
    algorithm = registry.create_steady(spec)
    if getattr(algorithm, "error_feedback", False) is not True:
        return False
    if algorithm.name == "int4":
        return algorithm.bits == GUARD_INT4["bits"] and algorithm.bucket_size <= GUARD_INT4["max_bucket_size"]
    return getattr(algorithm, "levels", 0) >= GUARD_MIN_LEVELS


def guarded_optimizer(optimizer):
    """``(name, kind)`` of the optimizer Horovod calls ``compress`` from: ``kind`` is ``"adaptive"``
    (its class or a base class is one of :data:`ADAPTIVE_OPTIMIZERS`), ``"momentum"`` (a parameter
    group with momentum, as torch's SGD keeps it) or None (plain SGD, under which top-k and
    PowerSGD ended within 1% of dense).

    >>> import torch
    >>> p = [torch.zeros(1, requires_grad=True)]
    >>> [guarded_optimizer(o) for o in (torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1, momentum=0.9),
    ...                                 torch.optim.SGD(p, lr=0.1))]
    [('AdamW', 'adaptive'), ('SGD', 'momentum'), ('SGD', None)]
    """
    names = [cls.__name__ for cls in type(optimizer).__mro__]
    adaptive = next((n for n in names if n in ADAPTIVE_OPTIMIZERS), None)
    if adaptive:
        return adaptive, "adaptive"
    if any(group.get("momentum", 0) for group in getattr(optimizer, "param_groups", ())):
        return names[0], "momentum"
    return names[0], None


class AutoRuntime:
    """The plan, the phases and the state of one ``Compression.auto`` (see the module docstring).

    Args: as ``Compression.auto`` (:class:`~horovod_sparse.torch.auto.TorchAutoCompressor`).

    Attributes:
        plan: ``{gradient key: choice}`` in effect, the same on every rank.
        phase: ``"warming"``, ``"profiling"``, ``"trying"`` or ``"settled"``.
        report: what was measured, predicted and chosen (the frontends' ``auto_report``).
        algorithms: ``{spec: algorithm}`` of the out-of-band candidates, in their order.
    """

    #: how the frontend carries the dense choices: "horovod" (Horovod's allreduce as backward
    #: produces the gradients, then the out-of-band exchanges) or "sequential" (every gradient
    #: through the frontend's own exchanges, one after the other)
    carried = "horovod"

    def __init__(self, candidates=DEFAULT_CANDIDATES, dense_below=DEFAULT_DENSE_BELOW, min_density=0.01,
                 min_rank=1, max_residual_ratio=DEFAULT_MAX_RESIDUAL_RATIO, profile_steps=3, trial_steps=3,
                 max_trials=5, prune=1.5, drift=0.2, check_every=20, nonfinite="propagate", warmup_steps=None,
                 guard_momentum=True):
        self.nonfinite = check_nonfinite(nonfinite)
        self.guard_momentum = check_bool("guard_momentum", guard_momentum)
        self.warmup_steps = checked_warmup(warmup_steps)
        self.min_density = check_positive_number("min_density", min_density)
        self.min_rank = check_positive_int("min_rank", min_rank)
        self.candidates = check_candidates(candidates, self.min_density, self.min_rank)
        self.dense_below = check_nonnegative_int("dense_below", dense_below)
        self.max_residual_ratio = check_positive_number("max_residual_ratio", max_residual_ratio)
        self.profile_steps = check_positive_int("profile_steps", profile_steps)
        if self.profile_steps < 2:
            raise ValueError(f"profile_steps must be an integer in [2, 2147483647], got {profile_steps!r}")
        self.trial_steps = check_positive_int("trial_steps", trial_steps)
        self.max_trials = check_positive_int("max_trials", max_trials)
        self.prune = check_positive_number("prune", prune)
        if self.prune < 1:
            raise ValueError(f"prune must be a number >= 1, got {prune!r}")
        self.drift = check_positive_number("drift", drift)
        self.check_every = check_positive_int("check_every", check_every)
        self.algorithms = {spec: registry.create_steady(spec) for spec in self.candidates if spec not in DENSE_CHOICES}
        self.choices = [NONE, FP16] + list(self.algorithms)
        # the plan; new keys get the profiling choice
        self.plan = {}
        self.phase = "warming" if self.warmup_steps else "profiling"
        self.report = {"phase": self.phase, "chosen": None, "per_choice": {}, "replans": [], "guard": [],
                       "skipped_steps": 0, "warmup_steps": self.warmup_steps}
        self.drain = {}        # key -> residual (numpy) to add to its next gradient: it left a candidate
        # this step's changes that a skipped step gives back: residuals drained, keys new to the plan
        self._taken, self._new_keys = {}, []
        # measurements: arrivals while profiling, step periods while trying and settled
        self.trace = ArrivalTrace()
        self._trials = None
        self._step_began = None
        self._periods = []     # settled: this window's step periods
        self._baseline = None  # settled: the first window's median (slowest rank)
        self._settled_steps = 0
        self.steps = 0         # steps ended (the report's step numbers)
        self.optimizer = None  # the optimizer's class name, once the frontend knows it (the guard's input)
        # the candidates auto may choose: all, or under AdamW or momentum SGD those that keep their
        # quality (:func:`keeps_recipe_quality`, set by :meth:`guard_optimizer`)
        self.allowed = self.candidates

    def guard_optimizer(self, optimizer):
        """The frontend found the optimizer (the same on every rank): under Adam's family or SGD
        with momentum (:func:`guarded_optimizer`) auto keeps to the candidates that keep their
        quality, and says so in ``report["optimizer_guard"]``."""
        self.optimizer, kind = guarded_optimizer(optimizer)
        # the user's call: top-k lost nothing on ResNet-18 under momentum SGD, 1.8% on the transformer
        waived = kind == "momentum" and not self.guard_momentum
        if kind and not waived:
            self.allowed = tuple(c for c in self.candidates if keeps_recipe_quality(c))
        if waived or self.allowed != self.candidates:
            why = (f"guard_momentum=False: every candidate kept ({MEASURED_COST[kind]}; top-k 0.01 ended level "
                   "with dense on ResNet-18, docs/results/accuracy.md)" if waived else
                   f"sparsifiers and low rank cost quality ({MEASURED_COST[kind]}, bits per byte after 1000 steps, "
                   "docs/results/accuracy.md); fp16, 8-bit quantizers and int4 with error feedback keep it")
            self.report["optimizer_guard"] = {"optimizer": self.optimizer, "kind": kind, "kept": list(self.allowed),
                                              "why": why}

    @property
    def profiling_choice(self):
        """What a gradient gets before the plan: the first allowed out-of-band candidate, else fp16."""
        return next((spec for spec in self.algorithms if spec in self.allowed), self.warming_choice)

    @property
    def warming_choice(self):
        """What a gradient gets while warming: fp16 where it is a candidate, else none."""
        return FP16 if FP16 in self.candidates else NONE

    def first_choice(self, numel):
        """What a gradient of ``numel`` elements new to the plan gets: ``"none"`` under
        ``dense_below``, else the warming choice or the profiling choice, by the phase."""
        if numel < self.dense_below:
            return NONE
        return self.warming_choice if self.phase == "warming" else self.profiling_choice

    def choice_for(self, key, numel):
        """The plan's choice for a float gradient of ``numel`` elements (a new key: :meth:`first_choice`)."""
        choice = self.plan.get(key)
        if choice is None:
            choice = self.plan[key] = self.first_choice(numel)
            self._new_keys.append(key)
        return choice

    # -- the frontend's hooks ----------------------------------------------------------------
    def fit_costs(self, known, sizes):
        """:class:`~horovod_sparse.auto.decide.Costs` measured on this job (collective)."""
        raise NotImplementedError

    def take_out(self, spec, keys):
        """``{key: {field: numpy slice}}`` of ``keys``' state in candidate ``spec``, removed from it."""
        raise NotImplementedError

    def overlaps(self):
        """Whether an exchange can run while backward goes on (the gradients are on a GPU)."""
        raise NotImplementedError

    def checked_gradients(self):
        """``{key: (its state slices in its candidate, its gradient's norm)}`` of this step's
        out-of-band gradients, this rank (the guard's inputs)."""
        raise NotImplementedError

    def candidate_states(self):
        """``{spec: state tree}`` of every candidate's gradients (numpy and numbers only)."""
        raise NotImplementedError

    def load_candidate_states(self, states):
        raise NotImplementedError

    # -- a step --------------------------------------------------------------------------------
    def start_step(self, now=None):
        """A step begins: the one before has ended, its period is known."""
        now = time.perf_counter() if now is None else now
        if self._step_began is not None:
            if self._trials is not None:
                self._trials.record(now - self._step_began)
            elif self.phase == "settled":
                self._periods.append(now - self._step_began)
        self._step_began = now if self.phase in ("trying", "settled") else None
        self._taken, self._new_keys = {}, []

    def drained(self, key):
        """The residual a gradient left behind when its choice changed (numpy, flat), once; or None.
        A skipped step gives it back (:meth:`skip_step`)."""
        residual = self.drain.pop(key, None)
        if residual is not None:
            self._taken[key] = residual
        return residual

    def skip_step(self, keep=()):
        """The step now ending overflowed on some rank: it is no step (every rank calls this at the
        same step, instead of :meth:`end_step`). Its arrivals are not profiled, its period is
        timed for nothing (the next step's start records none), no counter moves, the plan
        forgets the keys it met first in this step, and the residuals drained into its
        gradients go back to wait for the next step, except those of ``keep``: gradients whose
        exchange took theirs in before the overflow was known (an exchange that ran earlier in
        the step; never, where the frontend learns the overflow before its first exchange)."""
        for key, residual in self._taken.items():
            if key not in keep:
                self.drain[key] = residual
        for key in self._new_keys:
            self.plan.pop(key, None)
        self._taken, self._new_keys = {}, []
        self.trace.discard_step()
        self._step_began = None
        self.report["skipped_steps"] += 1

    def end_step(self, comm, sizes, backward_end=None):
        """The phase's bookkeeping after the step's exchanges; ``sizes``: ``{key: elements}`` of
        the step's float gradients; ``backward_end``: when backward ended (``time.perf_counter``;
        None: now). Collective: every rank, the same step."""
        self.steps += 1
        if self.phase == "warming":
            if self.steps >= self.warmup_steps:  # the candidates take the gradients from the next step
                self.phase = self.report["phase"] = "profiling"
                self.adopt({k: self.first_choice(sizes[k]) for k in self.plan if k in sizes})
        elif self.phase == "profiling":
            self.trace.end_step(at=backward_end)
            if len(self.trace.steps) >= self.profile_steps:
                self._make_plans(comm, sizes)
        elif self.phase == "trying":
            if self._trials.finished or self._trials.step_ran():
                self._next_trial(comm)
        else:
            self._settled_steps += 1
            if self._settled_steps % self.check_every == 0:
                self._check(comm)

    # -- 1. profile, predict, shortlist ------------------------------------------------------
    def _make_plans(self, comm, sizes):
        started = time.perf_counter()
        known = sorted(sizes, key=key_order)
        check_same_on_every_rank(";".join(f"{k}:{sizes[k]}" for k in known), comm, "gradients (names and sizes)")
        costs = self.fit_costs(known, sizes)
        shortlisted = None
        if comm.Get_rank() == 0:
            order, compute, tail = self.trace.backward_trace(known)
            profile = StepProfile(tuple(order), tuple(sizes[k] for k in order), tuple(compute), tail,
                                  overlap=self.overlaps())
            plans = make_plans(profile, costs, self.allowed, self.dense_below)
            shortlisted = shortlist(plans, profile, costs, self.prune, self.max_trials,
                                    carried_by_horovod=self.carried == "horovod")
            self.report["backward_s"] = profile.backward_end
        shortlisted = self._broadcast(comm, shortlisted, known)
        self.report.update(
            phase="trying", chosen=None, profiled_steps=len(self.trace.steps),
            profile_s=time.perf_counter() - started,
            costs={"dense": [costs.dense.a, costs.dense.b],
                   **{spec: [c.a, c.b] for spec, c in costs.candidates.items()}},
            trials=[{"plan": name, "predicted_s": seconds, "measured_s": None,
                     "per_choice": count_choices(plan)} for name, plan, seconds in shortlisted])
        self.trace = ArrivalTrace()
        self._trials = PlanTrials([(name, plan) for name, plan, _ in shortlisted], self.trial_steps)
        self.phase = "trying"
        self.adopt(shortlisted[0][1])

    def _broadcast(self, comm, shortlisted, known):
        """Rank 0's ``[(name, plan, predicted seconds)]`` on every rank: the plans as indices into
        :attr:`choices` (int64), the names as UTF-8 bytes, the predictions as float64."""
        mine = comm.Get_rank() == 0
        names = "\n".join(name for name, _, _ in shortlisted).encode() if mine else b""
        header = np.array([len(shortlisted), len(names)] if mine else [0, 0], dtype=np.int64)
        comm.Bcast(header, root=0)
        count, length = int(header[0]), int(header[1])
        table = (np.array([[self.choices.index(plan[k]) for k in known] for _, plan, _ in shortlisted], np.int64)
                 if mine else np.empty((count, len(known)), np.int64))
        seconds = np.array([s for _, _, s in shortlisted], np.float64) if mine else np.empty(count, np.float64)
        text = np.frombuffer(names, np.uint8).copy() if mine else np.empty(length, np.uint8)
        for array in (table, seconds, text):
            comm.Bcast(array, root=0)
        return [(name, {k: self.choices[int(i)] for k, i in zip(known, row)}, float(s))
                for name, row, s in zip(text.tobytes().decode().split("\n"), table, seconds)]

    # -- 2. try -------------------------------------------------------------------------------
    def _next_trial(self, comm):
        trials, report = self._trials, self.report
        if trials.finished:
            best, timed = trials.decide(comm)
            for row, steps in zip(report["trials"], timed):
                row.update(measured_s=statistics.median(steps), steps_s=steps)
            name, plan = trials.candidates[best]
            self._trials = None
            self.phase = "settled"
            self._periods, self._baseline, self._settled_steps = [], None, 0
            report.update(phase="settled", chosen=name, settled_at_step=self.steps)
            if comm.Get_rank() == 0:
                log.info("horovod_sparse auto chose %s: %s", name, report["trials"])
        else:
            plan = trials.candidates[trials.index][1]
        started = time.perf_counter()
        self.adopt(plan)
        if self._step_began is not None:  # a switch is no part of the step's period
            self._step_began += time.perf_counter() - started

    def adopt(self, plan):
        """Run ``plan`` (``{key: choice}``, all keys or some) from the next step on. A gradient
        that leaves a candidate takes its residual along (:meth:`drained`)."""
        for spec in self.algorithms:
            leaving = [k for k, choice in self.plan.items() if choice == spec and plan.get(k, choice) != spec]
            if not leaving:
                continue
            for key, fields in self.take_out(spec, leaving).items():
                residual = residual_of(fields)
                if residual is not None:
                    self.drain[key] = np.array(residual, dtype=np.float32, copy=True)
        self.plan = {**self.plan, **plan}
        self.report["per_choice"] = count_choices(self.plan)
        self.report["plan"] = dict(self.plan)

    # -- 3. settled: the guard and the drift ----------------------------------------------------
    def _check(self, comm):
        """Collective, every ``check_every`` settled steps: one Allreduce(MAX) of this window's
        median step and every error-feedback gradient's residual ratio."""
        ratios = {key: float(np.linalg.norm(residual_of(fields))) / max(norm, 1e-30)
                  for key, (fields, norm) in self.checked_gradients().items() if residual_of(fields) is not None}
        # a ratio that is not finite (a norm past float's range) says nothing: -inf loses to every
        # other rank's ratio in the maximum, and the guard ignores one left non-finite
        ratios = {key: r if math.isfinite(r) else -math.inf for key, r in ratios.items()}
        keys = sorted(ratios, key=key_order)
        window = statistics.median(self._periods) if self._periods else 0.0
        most, fewest = max_over_ranks(comm, [len(keys), -len(keys)])  # counts first: the next Allreduce's length
        if most != -fewest:
            raise ValueError("auto: the ranks' gradients differ (another set of error-feedback gradients "
                             "on some rank); every rank must train the same parameters")
        slowest = max_over_ranks(comm, [window] + [ratios[k] for k in keys])
        window, ratios = float(slowest[0]), dict(zip(keys, slowest[1:].tolist()))
        self._periods = []
        refused = guard_violations(ratios, self.max_residual_ratio)
        if refused:
            fallback = FP16 if FP16 in self.candidates else NONE
            self.report["guard"].append({"step": self.steps, "moved_to": fallback,
                                         "keys": refused, "ratios": [ratios[k] for k in refused]})
            self.adopt({k: fallback for k in refused})
            self._baseline = None  # another plan: its step time is the next window's
            return
        if self._baseline is None:
            self._baseline = window
        elif abs(window / self._baseline - 1) > self.drift:
            self.report["replans"].append({"step": self.steps, "window_s": window, "baseline_s": self._baseline})
            self.phase = self.report["phase"] = "profiling"
            self.trace = ArrivalTrace()

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self):
        """The plan, the phase (with the trials so far), the residuals left behind and each
        candidate's state by gradient key (:mod:`horovod_sparse.state_format`)."""
        trials = None
        if self._trials is not None:
            trials = {"names": [n for n, _ in self._trials.candidates],
                      "plans": [dict(p) for _, p in self._trials.candidates],
                      "ran": self._trials.ran, "times": list(self._trials.times)}
        return {"auto": {"phase": self.phase, "plan": dict(self.plan), "trials": trials,
                         "chosen": self.report.get("chosen"), "steps": self.steps},
                "candidates": self.candidate_states(),
                "drain": {key: r.copy() for key, r in self.drain.items()}}

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict` (before the first step or between steps). A run saved while
        profiling profiles again; one saved while trying goes on with the plans left to try."""
        unknown = sorted(set(state_dict.get("candidates", {})) - set(self.algorithms))
        if "auto" not in state_dict or unknown:
            raise ValueError(f"auto: not the state of an auto compressor with candidates {self.candidates}"
                             + (f" (it has {unknown})" if unknown else ""))
        saved = state_dict["auto"]
        self.load_candidate_states(state_dict.get("candidates", {}))
        self.drain = {key: np.array(r, dtype=np.float32, copy=True) for key, r in state_dict.get("drain", {}).items()}
        self.plan, self.phase = dict(saved["plan"]), saved["phase"]
        # a state saved before the warming phase existed has no step count: its warm-up is over
        self.steps = int(saved.get("steps", self.warmup_steps))
        self.trace, self._trials, self._step_began = ArrivalTrace(), None, None
        self._periods, self._baseline, self._settled_steps = [], None, 0
        self._taken, self._new_keys = {}, []
        if saved.get("trials") is not None:
            t = saved["trials"]
            self._trials = PlanTrials(list(zip(t["names"], [dict(p) for p in t["plans"]])), self.trial_steps)
            self._trials.ran, self._trials.times = int(t["ran"]), [float(x) for x in t["times"]]
        self.report.update(phase=self.phase, chosen=saved.get("chosen"), per_choice=count_choices(self.plan),
                           plan=dict(self.plan))

    def settings(self):
        """The arguments, as text: every rank must pass the same."""
        return (f"candidates={self.candidates}, dense_below={self.dense_below}, min_density={self.min_density}, "
                f"min_rank={self.min_rank}, max_residual_ratio={self.max_residual_ratio}, "
                f"profile_steps={self.profile_steps}, trial_steps={self.trial_steps}, max_trials={self.max_trials}, "
                f"prune={self.prune}, drift={self.drift}, check_every={self.check_every}, nonfinite={self.nonfinite}, "
                f"warmup_steps={self.warmup_steps}, guard_momentum={self.guard_momentum}")


def residual_of(fields):
    """Error feedback's residual among a gradient's state slices (``{field: array}``), or None."""
    return next((fields[f] for f in RESIDUAL_FIELDS if f in fields), None)


def fit_line(points):
    """A :class:`CostModel` through ``[(bytes, seconds)]``, clamped at >= 0; through one size
    alone, proportional to the bytes (a constant would make a whole model as cheap as its
    first gradient)."""
    if len({p[0] for p in points}) < 2:
        return CostModel(0.0, points[0][1] / max(points[0][0], 1))
    line, _ = CostModel.fit(*zip(*points))
    return CostModel(max(line.a, 0.0), max(line.b, 0.0))


def count_choices(plan):
    """``{choice: number of gradients}`` of a plan."""
    out = {}
    for choice in plan.values():
        out[choice] = out.get(choice, 0) + 1
    return out
