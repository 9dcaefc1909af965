"""The PyTorch out-of-band compressor: one fused exchange per step, behind the stock
``hvd.DistributedOptimizer``, for the compressors Horovod's allreduce cannot carry
(sparsifiers, bit-packed quantizers, PowerSGD, FFT).

Horovod calls ``compress`` for every gradient of a step (from the backward hooks and
``synchronize()``) before the step's first ``decompress``. So:

1. ``compress`` records the gradient under its parameter's name (read from the calling
   Horovod code; its position in the step where no name is visible) and hands Horovod a
   one-element probe (its reduced value gives the Average/Sum scale,
   :mod:`horovod_sparse.out_of_band`);
2. the step's first ``decompress`` runs the pipeline on the recorded gradients, ordered by
   name (Horovod compresses the gradients missing from the backward pass in
   ``synchronize()``, in an order that differs between steps and ranks), as one buffer: a
   sparsifier gets them as pieces of it (its memory reads them in place: grad + residual
   in one pass), the other pipelines a copy in one persistent float32 buffer on their
   device (:class:`FusedBuffer`). One exchange per step, on the ranks of the optimizer's
   process set; the ranks first agree on the layout (one 24-byte Allgather), so ranks
   whose gradients differ fail together with a clear error;
3. each ``decompress`` writes its gradient's part of the sum into the gradient tensor
   itself (zeroed, then the summed pairs scattered in for sparsifiers; copied from the
   dense sum for the others), scaled by its probe, and returns it - in place, as
   Horovod's own allreduce does. Only the pipeline's payload ever leaves the device.
   If some rank's gradient overflowed (inf or NaN), no state changes and every
   out-of-band gradient of the step is NaN on every rank (:mod:`horovod_sparse.nonfinite`).

The warm-up's dense steps (:mod:`horovod_sparse.warmup`: top-k's, Ok-Topk's and PowerSGD's
first ``warmup_steps``, and the first steps of top-k's ramp while its count reaches n / P) are
carried by Horovod's own allreduce: there the pipeline would send
every element and keep nothing back (its residual stays zero), which is what Horovod's
allreduce does - overlapped with backward, fused by Horovod, without our local passes. The
compressor counts those steps (a step whose sums are not finite on every rank is not one,
as the overflow rule wants; with ``nonfinite="raise"`` it raises at the step's last
``decompress``), saves the count as the step counter of its state, and the pipelines start
from it at the first compressed step, so the ramp and the schedule's profiling come after.

Exact steps (:mod:`horovod_sparse.exact_steps`) ride the same path: where the optimizer has an
``exact_schedule`` (:class:`horovod_sparse.torch.AdamW`), read from the optimizer calling the
compressor, the steps it names are carried by Horovod's allreduce too, uncompressed (or cast to
fp16, as Horovod's ``Compression.fp16`` does, where the optimizer's ``exact_compression`` says so;
with ``"int8"`` or ``"int6"`` they are exchanged out of band instead, as the compressed steps are,
by a code of their own: :data:`~horovod_sparse.exact_steps.EXACT_CODES`, one more :class:`Bucket`), and leave
the pipelines' state (residuals, step counters) as it was. The compressor counts every step it
exchanged whose sums are finite (``steps_exchanged``, saved with its state where a schedule is
in use) and reports the last one as ``exact_report``: ``(its 0-based index, whether its average
was exact)``; every carried step (the warm-up's too) is exact, every pipeline step is not. The
optimizer checks the report against its own count, so the two cannot drift apart silently.

A frozen parameter (``requires_grad`` False, as in fine-tuning schedules) leaves the fused
layout at the step it is frozen on every rank: its residual is kept aside, untouched, and
restored when it is unfrozen (:mod:`horovod_sparse.layout_pipeline`), never drained into a frozen
parameter. Horovod still reduces its gradient, which it zero-fills: it gets a probe like
the others (so Horovod's payloads never differ across ranks, whatever a rank froze) and a
zero result; a non-zero gradient on a frozen parameter is refused on every rank.

When and in which buckets the gradients are exchanged is the schedule's business
(:class:`~horovod_sparse.step.exchanges.StepExchanges`): one exchange after backward
by default; with ``schedule=``, planned buckets on channel threads while backward goes on.
"""
import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from horovod_sparse.agreement import check_same_on_every_rank, communicator_of
from horovod_sparse.checks import check_choice, check_positive_int
from horovod_sparse.compressors.cast import FP16Compressor
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.exact_steps import EXACT_CODES
from horovod_sparse.horovod_frames import OneOptimizer, caller_gradient, caller_process_set, check_caller
from horovod_sparse.layout_pipeline import PIPELINE_KEY
from horovod_sparse.nonfinite import check_nonfinite, raise_with_hint
from horovod_sparse.ops.torch_ops import TorchOps
from horovod_sparse.out_of_band import OutOfBandCompressorBase
from horovod_sparse.registry import create
from horovod_sparse.schedule.planner import SCHEDULES
from horovod_sparse.step.bucket import Bucket
from horovod_sparse.step.exchanges import StepExchanges
from horovod_sparse.torch.buckets import TORCH_ARRAYS, FiniteCheck, NonFiniteSum, probe_scale

#: how an optimizer's exact steps travel where its schedule says ``compression="fp16"``
FP16_EXACT = FP16Compressor()
#: ``state_dict`` key of the count of steps exchanged (where an exact-step schedule is in use)
STEPS_KEY = "(steps)"


class TorchOutOfBandCompressor(OutOfBandCompressorBase, HorovodCompressor):
    """A real ``horovod.torch.compression.Compressor`` that exchanges the fused step out of band.

    Args:
        algorithm: an out-of-band compressor (``horovod_sparse.create("topk:density=0.01")``).
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
        nonfinite: what a step does when some rank's gradient holds inf or NaN (a loss
            scaler's overflow): ``"propagate"`` (default) writes NaN into every out-of-band
            gradient on every rank, so the scaler skips the step; ``"raise"`` raises
            :class:`~horovod_sparse.exchange.NonFiniteGradientError` on every rank. Either
            way no state changes (:mod:`horovod_sparse.nonfinite`).

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

    def __init__(self, algorithm, dense_below=None, schedule="after_backward", profile_steps=3, trial_steps=5,
                 nonfinite="propagate"):
        super().__init__(algorithm, *(() if dense_below is None else (dense_below,)))
        self.nonfinite = check_nonfinite(nonfinite)
        self.schedule = check_choice("schedule", schedule, SCHEDULES)
        self.profile_steps = check_positive_int("profile_steps", profile_steps)
        self.trial_steps = check_positive_int("trial_steps", trial_steps)
        self.exchanges = StepExchanges(algorithm, TORCH_ARRAYS, self.schedule, self.profile_steps, self.trial_steps)
        # this step's gradients, as compress hands them over
        self._position = 0
        self._step_finished = True  # the next compress starts a step
        self._recorded = {}    # key -> gradient, this step
        self._frozen = {}      # key -> gradient of a frozen parameter, this step
        self._results = None   # the step's sums (StepSum or ChannelExchanges), after its exchange
        # whether this step's gradients that Horovod carries as they are (small ones) are all
        # finite: an overflow there skips the whole step's exchange too
        self._carried = FiniteCheck()
        self._caller_checked = False
        self._schedule_agreed = False  # every rank's optimizer has the same exact-step schedule
        self._optimizer = OneOptimizer(algorithm.name)  # one compressor per optimizer: refuse a second
        # the warm-up's dense steps, carried by Horovod (module docstring); their count depends
        # on P (a ramp's first steps send the whole buffer too): until the first compress tells
        # P, the count at P = 1 (the dense steps alone)
        self._dense_steps = algorithm.dense_steps(1)
        self._carried_steps = 0      # steps done before the pipelines take over (an overflowed one is none)
        self._hand_over = False      # the pipelines have yet to start at step _carried_steps
        self._carrying = False       # this step is one of them
        self._carried_sums = None    # whether Horovod's sums of this carried step are all finite
        self._decompressed = 0       # of this carried step's gradients (the last one ends the step)
        self._warming = False        # this carried step is one of the warm-up's (else an exact step)
        self._carried_codec = None   # how this carried step travels: as it is, or in fp16 (an exact step's choice)
        self._exact_out_of_band = False  # this step is an exact step exchanged by the bucket below
        self._exact_bucket = None    # that bucket (stateless: no error feedback), made at its first step
        self.steps_exchanged = 0     # steps whose sums were finite, carried or compressed
        self.exact_report = None     # (index, exact) of the last of them; None before one, and after a load

    def compress(self, tensor):
        if self._step_finished and self.elastic_handler is not None and self._caller_checked:
            self.elastic_handler.follow_removals(self._world_size)
        if not self._caller_checked:
            check_caller(self.algorithm.name, hvd.Adasum, _DistributedAdasumOptimizer._allreduce_grad_async.__code__,
                         process_sets=True)
            self.use_communicator(communicator_of(caller_process_set()))
            self._caller_checked = True
            self._dense_steps = self.algorithm.dense_steps(self.world_size)
        name, parameter, optimizer = caller_gradient(tensor, optimizer=True)
        self._optimizer.check(optimizer)  # before the step starts: the optimizer's schedule decides it
        if not self._schedule_agreed:
            # ranks on different exact steps would hand Horovod differently shaped allreduces
            # (a gradient on one rank, a probe on another): name the cause before the first one
            check_same_on_every_rank(f"exact steps {self.exact_schedule}", self._comm,
                                     "exact-step schedules (horovod_sparse.torch.AdamW's exact_warmup, max_interval "
                                     "and exact_compression)")
            self._schedule_agreed = True
        if self._step_finished:
            self._start_step()
        key = self._position if name is None else name
        self._position += 1
        if self._carrying:  # a dense warm-up step or an exact step: Horovod's allreduce, as it is (or in fp16)
            return self.compress_dense(tensor, key, self._carried_codec)
        if self.goes_dense(tensor):
            if tensor.is_floating_point():
                self._carried.add(tensor)
            return self.compress_dense(tensor, key)
        if key in self._recorded or key in self._frozen:
            raise ValueError(f"{self.algorithm.name}: gradient {key!r} was compressed twice in one step "
                             "(one compressor instance per optimizer, one name per tensor)")
        frozen = parameter is not None and not parameter.requires_grad
        (self._frozen if frozen else self._recorded)[key] = tensor
        if not self._exact_out_of_band:  # the schedule's buckets are the compressed steps'
            self.exchanges.arrived(key, self._recorded, self._frozen)
        probe = torch.ones(1, dtype=torch.float32, device=tensor.device)
        self.record(key, tensor, probe)
        return probe, ("sparse", key)

    def _start_step(self):
        self._position, self._step_finished = 0, False
        self._recorded, self._frozen, self._results = {}, {}, None
        self._carried = FiniteCheck()
        self._warming = self._carried_steps < self._dense_steps
        schedule = self.exact_schedule
        exact = not self._warming and schedule is not None and schedule.is_exact(self.steps_exchanged)
        self._exact_out_of_band = exact and schedule.compression in EXACT_CODES
        self._carrying = self._warming or (exact and not self._exact_out_of_band)
        if self._carrying:
            self._carried_sums, self._decompressed = FiniteCheck(), 0
            self._carried_codec = FP16_EXACT if exact and schedule.compression == "fp16" else None
            return
        if self._exact_out_of_band:  # out of band, by the exact steps' own bucket (at the first decompress)
            if self._exact_bucket is None:
                self._exact_bucket = Bucket(create(EXACT_CODES[schedule.compression]), TORCH_ARRAYS)
            return
        if self._hand_over:  # the first compressed step: the pipelines count the carried steps in
            self.exchanges.load_state_dict({PIPELINE_KEY: {"step": self._carried_steps}})
            self._hand_over = False
        self.exchanges.start_step(self.comm)

    def _end_carried_step(self):
        """At a carried step's last ``decompress`` (Horovod compresses all of a step's gradients
        before its first ``decompress``): count it if Horovod's sums are finite, which they are
        on every rank or on none."""
        if self._carried_sums.all():
            self._count_step(exact=True)
            if self._warming:
                self._carried_steps += 1
                self._hand_over = True
        elif self.nonfinite == "raise":
            self._optimizer.abandon_step()
            raise_with_hint(NonFiniteGradientError(
                f"{self.algorithm.name}: a gradient of this warm-up step is not finite (inf or NaN) on some rank: "
                "Horovod's sum of it is not finite on every rank"))

    def decompress(self, tensor, ctx):
        self._step_finished = True
        if ctx is None:  # a sparse gradient (nn.Embedding(sparse=True)) Horovod allgathered
            return tensor
        kind, info = ctx
        if kind == "dense":
            summed = self.decompress_dense(tensor, info)
            if self._carrying:
                self._carried_sums.add(summed)
                self._decompressed += 1
                if self._decompressed == self._position:
                    self._carrying = False
                    self._end_carried_step()
            return summed
        if self._results is None:
            try:
                if self._exact_out_of_band:
                    self._results = self._exact_bucket.exchange(self._recorded, self._frozen, self.comm,
                                                                f"{self.algorithm.name} (exact step out of band)",
                                                                self._carried.all())
                else:
                    self._results = self.exchanges.finish(self._recorded, self._frozen, self._carried.all())
            except NonFiniteGradientError as error:  # every rank is here: the check was agreed
                if self.nonfinite == "raise":
                    self._optimizer.abandon_step()
                    raise_with_hint(error)
                self._results = NonFiniteSum(self._recorded, self._frozen)
            else:
                self._count_step(exact=self._exact_out_of_band)
            self.pipelines = ({"(exact)": (self._exact_bucket.layout, self._exact_bucket.pipeline)}
                              if self._exact_out_of_band else self.exchanges.pipelines)
        return self._results.write(info, probe_scale(tensor, self.world_size))

    def _count_step(self, exact):
        self.exact_report = (self.steps_exchanged, exact)
        self.steps_exchanged += 1

    @property
    def exact_schedule(self):
        """The :class:`~horovod_sparse.exact_steps.ExactSteps` of the optimizer this compressor
        belongs to (its ``exact_schedule``), or None: then only the warm-up's steps are exact."""
        return getattr(self._optimizer.optimizer, "exact_schedule", None)

    @property
    def schedule_report(self):
        """Once planned: what was measured and chosen (None before, and without a schedule)."""
        return self.exchanges.report

    def last_step_timeline(self):
        """With a plan: when the last step's gradients arrived and its buckets were exchanged
        (:meth:`~horovod_sparse.step.channels.ChannelExchanges.timeline`); None before."""
        return self.exchanges.timeline()

    # -- checkpointing: by gradient key, so that state follows its parameter ------------
    def state_dict(self):
        """``{parameter name: {field: its slice of the residual...}}`` plus the pipelines'
        whole-buffer state under ``"(fused)"`` (with a plan, its buckets, each bucket's state
        and the plan itself; during the warm-up's carried steps, their count as ``"step"``);
        numbers, strings and numpy arrays only (:mod:`horovod_sparse.state_format`). Each
        rank saves its own."""
        state = self.exchanges.state_dict()
        if self._carried_steps < self._dense_steps or self._hand_over:
            state[PIPELINE_KEY] = {**state.get(PIPELINE_KEY, {}), "step": self._carried_steps}
        if self.exact_schedule is not None:  # the schedule's counter (carried exact steps leave the pipelines' alone)
            state[STEPS_KEY] = {"step": self.steps_exchanged}
        return state

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`, now or at the first step; a gradient's state goes back to
        it by name, whatever the layout then. A saved plan is resumed if this compressor has a
        schedule (not ``"after_backward"``); one saved while ``"auto"`` was still trying its
        candidates is not: the residuals are, and the resumed run profiles and tries again."""
        state_dict = dict(state_dict)
        whole = state_dict.get(PIPELINE_KEY) or {}
        self._carried_steps, self._hand_over = int(whole.get("step", 0)), False
        # saved without a schedule: no exact step left the pipelines, whose counter is then the count
        self.steps_exchanged = int((state_dict.pop(STEPS_KEY, None) or whole).get("step", 0))
        self.exact_report = None
        self.exchanges.load_state_dict(state_dict)

    def rejoin(self, state):
        """Go on in a world elastic Horovod has formed anew (workers came or went): the exchanges
        are made again on the new world's ranks at the next step (which reads the caller's
        process set and P again), from ``state`` (:meth:`state_dict`'s form; what carries over
        is :mod:`horovod_sparse.torch.elastic`'s business). A step in progress is dropped:
        elastic Horovod runs it again."""
        self.close()
        self.exchanges = StepExchanges(self.algorithm, TORCH_ARRAYS, self.schedule, self.profile_steps,
                                       self.trial_steps)
        self._exact_bucket = None  # its pipeline was made on the old world's ranks
        self.pipelines, self._comm = {}, None
        self._caller_checked = self._schedule_agreed = False
        self._step_finished, self._carrying = True, False
        self._dense_steps = self.algorithm.dense_steps(1)  # until the next compress tells P
        self.load_state_dict(state)

    def regime(self):
        """``{buffer key: what its next step does}``; during the warm-up's carried steps
        ``{"horovod": "warm-up: dense until step N, on Horovod's allreduce"}`` (before the first
        step N is ``warmup_steps``: the ramp's dense steps are counted in once P is known); on an
        optimizer's exact step ``{"horovod": "exact every 32 steps (step 387 exact), on Horovod's allreduce"}``."""
        if self._carried_steps < self._dense_steps:
            return {"horovod": f"warm-up: dense until step {self._dense_steps}, on Horovod's allreduce"}
        schedule = self.exact_schedule
        if schedule is not None and schedule.is_exact(self.steps_exchanged):
            if schedule.compression in EXACT_CODES:
                code = EXACT_CODES[schedule.compression]
                return {"(exact)": f"{schedule.describe(self.steps_exchanged)}, out of band in "
                                   f"{schedule.compression[3:]} bits ({code})"}
            in_fp16 = " in fp16" if schedule.compression == "fp16" else ""
            return {"horovod": f"{schedule.describe(self.steps_exchanged)}, on Horovod's allreduce{in_fp16}"}
        return super().regime()

    def close(self):
        self.exchanges.close()
        if self._exact_bucket is not None:
            self._exact_bucket.close()
