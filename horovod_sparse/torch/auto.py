"""``Compression.auto()`` for PyTorch: per gradient, Horovod's allreduce (fp32 or fp16) or one
out-of-band candidate, decided on the user's own job by measurement, behind the stock
``hvd.DistributedOptimizer``. How it decides: :mod:`horovod_sparse.auto.runtime`.

Each step:

1. ``compress`` looks the gradient's choice up in the plan. A dense choice goes to Horovod's
   allreduce as Horovod's own ``none`` or ``fp16`` compressor would send it; an out-of-band
   one is recorded and Horovod carries a one-element probe (as
   :class:`~horovod_sparse.torch.out_of_band.TorchOutOfBandCompressor` does). A residual the
   gradient left behind in a change of plan is added to it first.
2. The step's first ``decompress`` exchanges each candidate's gradients as one fused bucket
   (:class:`~horovod_sparse.step.bucket.Bucket`), then lets the runtime do its phase's
   bookkeeping (collective: every rank, the same step).
3. Each ``decompress`` returns Horovod's result (dense) or writes its part of its bucket's sum.

A loss scaler's overflow (:mod:`horovod_sparse.nonfinite`): a gradient holding inf or NaN on
some rank makes the step no step on every rank, with no state of auto's changed
(:meth:`~horovod_sparse.auto.runtime.AutoRuntime.skip_step`). Every rank learns it from what
the step sends anyway:

- when a candidate's bucket runs, from the bucket's agreement header: each pipeline checks
  its own gradients, and a rank whose dense payloads (checked as ``compress`` hands them to
  Horovod, since Horovod then sums them in place) are not finite gives its buckets a NaN
  gradient, so that every bucket raises :class:`~horovod_sparse.exchange.NonFiniteGradientError`
  on every rank before any state changed; every out-of-band gradient's result is then NaN;
- when no bucket runs (a plan of Horovod's allreduce only), from Horovod's sums, the same on
  every rank: the step's bookkeeping waits for its last ``decompress``, which has seen them all.

Horovod's own sums of a non-finite gradient are non-finite by themselves. With
``nonfinite="raise"`` every rank raises the error at the step's last ``decompress`` (Horovod has
waited for every allreduce of the step by then).
"""
import time

import horovod.torch as hvd
import torch
from horovod.torch.compression import Compressor as HorovodCompressor
from horovod.torch.compression import FP16Compressor, NoneCompressor
from horovod.torch.optimizer import _DistributedAdasumOptimizer

from horovod_sparse.agreement import check_same_on_every_rank, communicator_of, time_collective
from horovod_sparse.auto.decide import DENSE_CHOICES, FP16, NONE, Costs
from horovod_sparse.auto.runtime import AutoRuntime, fit_line
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.horovod_frames import OneOptimizer, caller_gradient, caller_process_set, check_caller
from horovod_sparse.layout import key_order
from horovod_sparse.nonfinite import raise_with_hint
from horovod_sparse.ops.namespace import host_shortcut_allowed
from horovod_sparse.out_of_band import refuse_what_the_transport_cannot_carry
from horovod_sparse.step.bucket import Bucket
from horovod_sparse.step.profiling import fit_exchange_cost, probe_lengths
from horovod_sparse.torch.buckets import TORCH_ARRAYS, FiniteCheck, NonFiniteSum, probe_scale

#: largest exchange (elements) timed to fit a cost; larger ones follow the line
PROBE_ELEMENTS = 1 << 22
#: largest Horovod allreduce timed (4 MB: 34 ms at 1 Gbit/s); the link's line goes on
DENSE_PROBE_ELEMENTS = 1 << 20
#: between the sizes probed: a coarse line is enough to rank the plans the trials then measure
PROBE_FACTOR = 16


class TorchAutoCompressor(AutoRuntime, HorovodCompressor):
    """A ``horovod.torch.compression.Compressor`` that picks, per gradient, what to compress and how.

    Args:
        candidates: spec strings: ``"none"``, ``"fp16"`` and out-of-band compressors with error
            feedback (default ``("fp16", "topk:density=0.01", "powersgd:rank=2",
            "qsgd:levels=127,error_feedback=true", "int4")``; Horovod's
            fp32 allreduce is always a choice).
        dense_below: gradients with fewer elements (and non-float ones) stay fp32 dense.
        min_density, min_rank: the quality guard's floors for sparsifier and PowerSGD candidates.
        max_residual_ratio: the guard's bound on a gradient's residual norm over its norm.
        profile_steps: steps profiled before the plans are predicted (>= 2; the first is warm-up).
        trial_steps: timed steps per shortlisted plan (after one warm-up step).
        max_trials: plans tried at most.
        prune: plans predicted slower than prune x the best are not tried (a number >= 1).
        drift: relative change of the settled step time that makes it plan again.
        check_every: steps between the settled checks (guard and drift).
        warmup_steps: steps at the start on a dense choice (fp16 where it is a candidate)
            before profiling (:mod:`horovod_sparse.warmup`; default ``$HOROVOD_SPARSE_WARMUP_STEPS``,
            else 100); ``auto_report()["phase"]`` is ``"warming"`` meanwhile.
        guard_momentum: under SGD with momentum keep to the candidates that keep quality, as
            under Adam's family (default True); False keeps every candidate there (top-k ended
            level with dense on ResNet-18 under momentum SGD, 1.8% behind on the transformer
            over two seeds). Adam's family is guarded either way.
        nonfinite: a step whose gradient holds inf or NaN on some rank (a loss scaler's
            overflow) changes no state of auto's on any rank; ``"propagate"`` (default) makes
            every out-of-band gradient's result NaN on every rank, so that the scaler skips the
            step as it does with Horovod's own allreduce; ``"raise"`` raises
            :class:`~horovod_sparse.exchange.NonFiniteGradientError` on every rank
            (:mod:`horovod_sparse.nonfinite`). ``auto_report["skipped_steps"]`` counts them.

    ``auto_report`` says what was measured, predicted and chosen; ``plan`` is the choice per
    parameter name; ``state_dict()`` holds both and every candidate's residuals (rank-0
    checkpoints: :mod:`horovod_sparse.checkpoint`). Use one instance per optimizer.

    Example::

        compression = hvds.Compression.auto()
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=compression)
        ...
        print(compression.auto_report["chosen"], compression.auto_report["per_choice"])
    """

    carried = "horovod"
    #: set by an elastic state that carries this compressor (horovod_sparse.torch.elastic)
    elastic_report = elastic_handler = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.buckets = {spec: Bucket(algorithm, TORCH_ARRAYS) for spec, algorithm in self.algorithms.items()}
        self._horovod = {NONE: NoneCompressor, FP16: FP16Compressor}
        self._comm = None
        self._world_size = None
        self._process_set = None
        self._optimizer = OneOptimizer("auto")  # one compressor per optimizer: refuse a second
        # this step, as compress hands it over
        self._position, self._step_finished = 0, True
        self._gradients = {}   # key -> every float gradient of the step (sizes, the guard)
        self._recorded = {spec: {} for spec in self.algorithms}
        self._frozen = {spec: {} for spec in self.algorithms}
        self._sums = None      # {spec: StepSum}, once the step's exchanges ran
        # the overflow check (module docstring)
        self._payloads = FiniteCheck()  # this rank's dense payloads, while a bucket may run
        self._check_payloads = True
        self._dense_sums = None          # Horovod's sums, when no bucket ran: the step's verdict waits for them
        self._overflow = None            # the step's NonFiniteGradientError, once known
        self._decompressed, self._backward_end = 0, None

    @property
    def auto_report(self):
        """What was measured, predicted and chosen: ``phase``, ``chosen`` (the plan's name),
        ``per_choice`` (gradients per choice), ``plan``, ``trials`` (each plan's predicted and
        measured seconds), ``costs`` (fitted a, b), ``replans`` and ``guard`` (what moved, when, why),
        ``skipped_steps`` (steps a gradient overflowed in, on some rank: no step of auto's)."""
        return self.report

    # -- Horovod's interface ------------------------------------------------------------
    def compress(self, tensor):
        if self._step_finished and self.elastic_handler is not None and self._comm is not None:
            self.elastic_handler.follow_removals(self._world_size)
        if self._comm is None:
            check_caller("auto", hvd.Adasum, _DistributedAdasumOptimizer._allreduce_grad_async.__code__,
                         process_sets=True)
            self._process_set = caller_process_set()
            self._comm = communicator_of(self._process_set)
            refuse_what_the_transport_cannot_carry(self._comm, self.algorithms.values(),
                                                   in_elastic_state=self.elastic_handler is not None)
            self._world_size = self._comm.Get_size()  # read once: decompress makes no MPI call (out_of_band.py)
            check_same_on_every_rank(self.settings(), self._comm, "auto settings")
        if self._step_finished:
            self._start_step()
        name, parameter, optimizer = caller_gradient(tensor, optimizer=True)
        self._optimizer.check(optimizer)
        if self.optimizer is None and optimizer is not None:
            self.guard_optimizer(optimizer)
        key = self._position if name is None else name
        self._position += 1
        if not tensor.dtype.is_floating_point:
            return tensor, (NONE, None)
        choice = self.choice_for(key, tensor.numel())
        if self.phase == "profiling":
            self.trace.arrived(key)
        frozen = parameter is not None and not parameter.requires_grad
        if not frozen:
            residual = self.drained(key)
            if residual is not None:  # left behind by a change of plan: nothing is dropped
                tensor = tensor + torch.from_numpy(residual).to(tensor.device, tensor.dtype).view(tensor.shape)
        self._gradients[key] = tensor
        if choice in DENSE_CHOICES:
            payload, ctx = self._horovod[choice].compress(tensor)
            if self._check_payloads:  # Horovod sums it in place: checked now or never
                self._payloads.add(payload)
            return payload, (choice, ctx)
        (self._frozen if frozen else self._recorded)[choice][key] = tensor
        return torch.ones(1, dtype=torch.float32, device=tensor.device), (choice, key)

    def decompress(self, tensor, ctx):
        self._step_finished = True
        if ctx is None:  # a sparse gradient (nn.Embedding(sparse=True)) Horovod allgathered
            return tensor
        if self._sums is None:
            self._exchange_step()
        choice, info = ctx
        if choice in DENSE_CHOICES:
            out = self._horovod[choice].decompress(tensor, info)
            if self._dense_sums is not None and out.is_floating_point():
                self._dense_sums.add(out)
        else:
            out = self._sums[choice].write(info, probe_scale(tensor, self._world_size))
        self._decompressed += 1
        if self._decompressed == self._position:  # the step's last: every sum of Horovod's is in
            self._settle_step()
        return out

    def _start_step(self):
        if self._dense_sums is not None:  # the last decompress never came (an error in between)
            self._settle_step(raising=False)
        self._position, self._step_finished, self._sums = 0, False, None
        self._decompressed, self._overflow, self._dense_sums = 0, None, None
        self._gradients = {}
        self._recorded = {spec: {} for spec in self.algorithms}
        self._frozen = {spec: {} for spec in self.algorithms}
        self._payloads = FiniteCheck()
        # the dense payloads matter only to a bucket: a plan of Horovod's allreduce alone (or an
        # empty one, before the first step) is judged by Horovod's sums instead
        self._check_payloads = not self.plan or any(c in self.algorithms for c in self.plan.values())
        self.start_step()

    def _exchange_step(self):
        """The step's out-of-band exchanges, one bucket per candidate in use, then the runtime's
        bookkeeping (or, if a gradient overflowed on some rank, none: the step is skipped); with
        no bucket to run, the bookkeeping waits for Horovod's sums (:meth:`_settle_step`).
        Collective: every rank calls it at its first ``decompress`` of the step."""
        self._backward_end = time.perf_counter()
        self._sums = {}
        planned = set(self.plan.values())
        in_use = [spec for spec in self.buckets if spec in planned]  # the same order on every rank
        busy = [spec for spec in in_use if self._recorded[spec]]
        if not busy:
            for spec in in_use:  # frozen gradients only: the ranks still agree on the layout
                self._sums[spec] = self.buckets[spec].exchange({}, self._frozen[spec], self._comm, spec)
            self._dense_sums = FiniteCheck()
            return
        if len(busy) > 1:  # a later bucket's overflow must not find an earlier one's state changed
            for spec in busy:
                for g in self._recorded[spec].values():
                    self._payloads.add(g)
        if not self._payloads.all():
            for spec in busy:  # the buckets' headers tell every rank
                key = min(self._recorded[spec], key=key_order)
                self._recorded[spec][key] = torch.full_like(self._recorded[spec][key], float("nan"))
        committed = set()
        try:
            for spec in in_use:
                self._sums[spec] = self.buckets[spec].exchange(self._recorded[spec], self._frozen[spec],
                                                               self._comm, spec)
                committed.update(self._recorded[spec])
        except NonFiniteGradientError as error:  # on every rank, at the same bucket: the check was agreed
            self._overflow = error
            self._sums = {spec: NonFiniteSum(self._recorded[spec], self._frozen[spec]) for spec in in_use}
            self.skip_step(keep=committed)
            return
        self.end_step(self._comm, {k: g.numel() for k, g in self._gradients.items()}, self._backward_end)

    def _settle_step(self, raising=True):
        """At the step's last ``decompress``: the bookkeeping that waited for Horovod's sums (the
        same on every rank: so is whether they are finite), and ``nonfinite="raise"``."""
        if self._dense_sums is not None:
            finite, self._dense_sums = self._dense_sums.all(), None
            if finite:
                self.end_step(self._comm, {k: g.numel() for k, g in self._gradients.items()}, self._backward_end)
            else:
                self._overflow = NonFiniteGradientError(
                    "auto: a gradient of this step is not finite (inf or NaN) on some rank: Horovod's sum of it "
                    "is not finite on every rank")
                self.skip_step()
        if raising and self._overflow is not None and self.nonfinite == "raise":
            error, self._overflow = self._overflow, None
            self._optimizer.abandon_step()
            raise_with_hint(error)

    # -- the runtime's hooks ----------------------------------------------------------------
    def fit_costs(self, known, sizes):
        """Horovod's allreduce at a few sizes, each candidate's bucket on copies of the step's
        gradients (:func:`~horovod_sparse.step.profiling.fit_exchange_cost`); slowest rank's times."""
        comm = self._comm
        process_set = hvd.global_process_set if self._process_set is None else self._process_set
        device = self._gradients[known[0]].device
        points = []
        for m in probe_lengths(min(sum(sizes.values()), DENSE_PROBE_ELEMENTS), PROBE_FACTOR):
            buffer = torch.zeros(m, dtype=torch.float32, device=device)
            run = (lambda b=buffer, m=m: hvd.allreduce(b, op=hvd.Sum, name=f"horovod_sparse.auto.probe.{m}",
                                                       process_set=process_set))
            points.append((4 * m, time_collective(comm, run, repeats=2)))
        fitted = {spec: fit_line(fit_exchange_cost(algorithm, TORCH_ARRAYS, known, self._gradients, [(comm, None)], spec,
                                                   repeats=1, factor=PROBE_FACTOR,
                                                   max_bytes=4 * PROBE_ELEMENTS)["points"])
                  for spec, algorithm in self.algorithms.items()}
        return Costs(dense=fit_line(points), candidates=fitted)

    def take_out(self, spec, keys):
        return self.buckets[spec].pipelines.take_out(keys)

    def overlaps(self):
        return not host_shortcut_allowed(next(iter(self._gradients.values())))

    def checked_gradients(self):
        out = {}
        for spec, bucket in self.buckets.items():
            if self._recorded[spec]:
                slices = bucket.pipelines.state_dict()
                out.update({key: (slices.get(key, {}), float(self._gradients[key].detach().float().norm()))
                            for key in self._recorded[spec]})
        return out

    def rejoin(self, state):
        """Go on in a world elastic Horovod has formed anew: each candidate's exchanges made again
        on the new world's ranks at the next step, from ``state`` (:meth:`load_state_dict`'s form;
        :mod:`horovod_sparse.torch.elastic` decides what carries over). A step in progress is
        dropped: elastic Horovod runs it again."""
        self.close()
        self.buckets = {spec: Bucket(algorithm, TORCH_ARRAYS) for spec, algorithm in self.algorithms.items()}
        self._comm = self._world_size = self._process_set = None
        self._position, self._step_finished, self._sums = 0, True, None
        self.load_state_dict(state)

    def candidate_states(self):
        return {spec: bucket.pipelines.state_dict() for spec, bucket in self.buckets.items()}

    def load_candidate_states(self, states):
        for spec, bucket in self.buckets.items():
            bucket.pipelines.load_state_dict(states.get(spec, {}))

    # -- accounting ---------------------------------------------------------------------------
    @property
    def pipelines(self):
        return {spec: (b.layout, b.pipeline) for spec, b in self.buckets.items() if b.pipeline is not None}

    def close(self):
        for bucket in self.buckets.values():
            bucket.close()

    def __repr__(self):
        return f"TorchAutoCompressor({self.settings()})"
