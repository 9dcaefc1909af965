"""``Compression.auto`` with every exchange on the host, in numpy: what the TensorFlow frontend
runs inside ``tf.numpy_function``, one call per Horovod exchange (one gradient, or one group).

A traced TensorFlow step cannot change what Horovod's allreduce carries without being traced
again, so here every gradient of at least ``dense_below`` elements goes through one call per
exchange, and the choices are applied inside it, step by step, in Python: ``"none"`` is an
MPI ``Allreduce`` in float32, ``"fp16"`` an ``Allgather`` of float16 payloads summed in
float32 (the same bytes as Horovod's ring at P = 2), a candidate its numpy pipeline over the
call's gradients of that choice. The calls run in trace order on every rank (the frontend
chains them), so each rank sees the same calls in the same order, and a step begins where a
call brings a gradient this step has already seen.

The profile: a gradient's backward time is its call's arrival less the end of the call
before it (calls wait for each other), and the plans are predicted with every gradient
exchanged one after the other (:func:`~horovod_sparse.auto.decide.predict`, not carried by
Horovod).

A loss scaler's overflow (:mod:`horovod_sparse.nonfinite`): the frontend hands the runtime,
in a host call before the step's first exchange, a few reductions of every float gradient of
the step on this rank (:meth:`HostAutoRuntime.step_verdict`: whether it is finite, its largest
and smallest element, reduced by TensorFlow once backward is done). At the step's first call
the runtime judges them by the plan of the step: every gradient finite, and every ``fp16``
gradient within float16's range (a finite float32 gradient past it is an overflow too: its
payload is inf, as Horovod's fp16 compressor makes it). Each call's layout agreement, the one
small Allgather every call makes before anything else, carries this rank's judgement, so all
ranks learn at the step's first call, before any state changed, that some rank overflowed:
from there on the step's calls exchange nothing and return NaN, and the step is no step of
auto's (:meth:`~horovod_sparse.auto.runtime.AutoRuntime.skip_step`). Without a verdict (a
compressor called outside Horovod's gradient list) each call judges its own gradients, and an
overflow seen at a later call leaves the earlier calls' exchanges as they ran.

    runtime = HostAutoRuntime(candidates=("fp16", "topk:density=0.01"))
    summed = runtime.exchange(("dense/kernel:0",), layout, flat)    # inside tf.numpy_function
"""
import time

import numpy as np

from horovod_sparse.agreement import agree_on_layout, communicator_of, time_collective
from horovod_sparse.out_of_band import refuse_what_the_transport_cannot_carry
from horovod_sparse.auto.decide import FP16, NONE, Costs
from horovod_sparse.auto.runtime import AutoRuntime, fit_line
from horovod_sparse.errors import NonFiniteGradientError
from horovod_sparse.layout import GradientLayout
from horovod_sparse.layout_pipeline import LayoutPipeline
from horovod_sparse.nonfinite import raise_with_hint
from horovod_sparse.ops.finite import all_finite

#: largest exchange (elements) timed to fit a cost; larger ones follow the line
PROBE_ELEMENTS = 1 << 22
#: the sizes probed, from 16 Ki elements up by this factor
PROBE_SIZES = (1 << 14, 1 << 18, 1 << 22)
#: the smallest float32 magnitude that float16 rounds to inf (65504 is float16's largest)
FP16_OVERFLOW = 65520.0


class HostAutoRuntime(AutoRuntime):
    """The auto runtime whose exchanges run on the host, in numpy (see the module docstring)."""

    carried = "sequential"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm = None
        # per candidate, per exchange (the tuple of keys one call brings): a pipeline whose
        # state follows each gradient
        self.pipelines = {spec: {} for spec in self.algorithms}
        self._saved = {}        # spec -> {exchange: state} loaded before its pipeline exists
        self._seen = set()      # keys exchanged this step
        self._sizes = {}        # key -> elements, this step
        self._waited = 0.0      # seconds of this step spent in exchanges so far
        self._values = {}       # key -> a copy of its gradient, kept for fitting the costs
        self._norms = {}        # key -> gradient norm, on steps the guard checks
        self.applied = {}       # key -> the choice it got in the current (or last) step
        self.on_gpu = False     # set by the frontend: where the gradients are
        # the overflow check (module docstring)
        self._verdict = None    # this rank's reductions of the coming step's gradients, or None
        self._unchecked = True  # this step came without a verdict: each call judges its gradients
        self._bad = False       # this rank's step so far overflowed (inf, NaN, or past float16 on fp16)
        self._overflowed = False  # the ranks agreed that this step overflowed: it exchanges nothing more
        self._committed = set()   # keys whose candidate took them in this step (a skip leaves their residual)

    def step_verdict(self, keys, sizes, finite, highs, lows):
        """This rank's reductions of the coming step's float gradients, before its first call
        (module docstring): per gradient of ``keys`` (``sizes``: elements, None where unknown),
        whether it is ``finite`` and its largest and smallest element (``highs``, ``lows``;
        -inf and inf for an empty one). Judged at the step's first call, by its plan."""
        self._verdict = (tuple(keys), tuple(sizes), np.asarray(finite, bool), np.asarray(highs, np.float32),
                         np.asarray(lows, np.float32))

    def _choice_of(self, key, size):
        """The choice ``key`` gets in this step (:meth:`choice_for`, without adding a new key)."""
        choice = self.plan.get(key)
        if choice is None and size is not None:
            choice = self.first_choice(size)
        return choice

    def _judged(self, verdict):
        """Whether this rank's step may go on: every gradient finite, and every fp16 one within
        float16's range."""
        keys, sizes, finite, highs, lows = verdict
        return bool(finite.all()) and not any(
            self._choice_of(key, size) == FP16 and (hi >= FP16_OVERFLOW or lo <= -FP16_OVERFLOW)
            for key, size, hi, lo in zip(keys, sizes, highs, lows))

    def _sound(self, key, g):
        """This rank's own judgement of one gradient (a call without a verdict, or a gradient a
        residual was drained into): finite, and within float16's range if its choice is fp16."""
        if not all_finite(g):
            return False
        return self._choice_of(key, g.size) != FP16 or g.size == 0 or float(np.max(np.abs(g))) < FP16_OVERFLOW

    def exchange(self, keys, layout, flat):
        """The sum over ranks of one call's gradients (``flat``: float32, ``layout`` over
        ``keys``), each by its choice. Collective: every rank, the same calls in the same order."""
        if self.comm is None:
            self.comm = communicator_of(None)
            refuse_what_the_transport_cannot_carry(self.comm, self.algorithms.values())
        arrived = time.perf_counter()
        if self._seen & set(keys):  # a gradient seen this step: the step before has ended
            if not self._overflowed:  # (an overflowed one was skipped when the ranks agreed on it)
                self.end_step(self.comm, self._sizes)
            self._seen, self._sizes, self._waited, self._norms = set(), {}, 0.0, {}
            self._overflowed, self._committed = False, set()
        if not self._seen:
            self.start_step(arrived)
            self.applied = {}
            verdict, self._verdict = self._verdict, None
            self._unchecked, self._bad = verdict is None, verdict is not None and not self._judged(verdict)
        self._seen.update(keys)
        for entry in layout.entries:
            self._sizes[entry.key] = entry.size
        if self._overflowed:  # every rank knows it, from the same call: nothing more is exchanged
            return np.full(layout.n, np.nan, np.float32)
        gradients, drained = {}, []
        for entry in layout.entries:
            g = flat[entry.offset:entry.offset + entry.size]
            residual = self.drained(entry.key)
            if residual is not None:
                g = g + residual
                drained.append(entry.key)
            gradients[entry.key] = g
        checked = gradients if self._unchecked else drained  # a residual can overflow a gradient
        self._bad = self._bad or not all(self._sound(key, gradients[key]) for key in checked)
        overflowed = self._agree(layout)  # ranks with other gradients fail together; an overflow skips
        if overflowed:
            return self._skip(NonFiniteGradientError(
                f"auto: a gradient of this step is not finite (inf or NaN) on rank(s) {overflowed}", ranks=overflowed),
                layout)
        if self.phase == "profiling":  # backward's time before it: the wait less the exchanges
            for entry in layout.entries:
                self.trace.arrived(entry.key, at=arrived - self._waited)
        if self.phase == "profiling" and len(self.trace.steps) + 1 >= self.profile_steps:
            self._values.update({k: np.array(g, copy=True) for k, g in gradients.items()})
        if self.phase == "settled" and (self._settled_steps + 1) % self.check_every == 0:
            self._norms.update({k: float(np.linalg.norm(g)) for k, g in gradients.items()})
        out = np.empty(layout.n, np.float32)
        by_choice = {}
        for entry in layout.entries:
            self.applied[entry.key] = self.choice_for(entry.key, entry.size)
            by_choice.setdefault(self.applied[entry.key], []).append(entry)
        for choice in [NONE, FP16, *self.algorithms]:  # the same order on every rank
            entries = by_choice.get(choice)
            if not entries:
                continue
            fused = np.concatenate([gradients[e.key] for e in entries]).astype(np.float32, copy=False)
            try:
                summed = self._sum(choice, tuple(keys), entries, fused)
            except NonFiniteGradientError as error:  # a residual overflowed: the pipeline's header agreed
                return self._skip(error, layout)
            if choice in self.algorithms:
                self._committed.update(e.key for e in entries)
            offset = 0
            for e in entries:
                out[e.offset:e.offset + e.size] = summed[offset:offset + e.size]
                offset += e.size
        self._waited += time.perf_counter() - arrived
        return out

    def _agree(self, layout):
        """One Allgather of every rank's layout tag and overflow verdict (the layout agreement
        of :func:`~horovod_sparse.agreement.agree_on_layout`, which every call makes first):
        ValueError on every rank if the layouts differ, else the ranks whose gradients are not
        all finite (none: go on)."""
        return agree_on_layout(layout, self.comm, "auto", flag=self._bad)

    def _skip(self, error, layout):
        """The step overflowed (every rank is here, at the same call): it is no step, this call
        and the step's next ones return NaN, or every rank raises with ``nonfinite="raise"``."""
        self._overflowed = True
        self.skip_step(keep=self._committed)
        if self.nonfinite == "raise":
            raise_with_hint(error)
        return np.full(layout.n, np.nan, np.float32)

    def _sum(self, choice, exchange, entries, fused):
        comm = self.comm
        if choice == NONE:
            total = np.empty_like(fused)
            comm.Allreduce(fused, total)
            return total
        if choice == FP16:  # Horovod's fp16 bytes; the sum in float32, in rank order on every rank
            gathered = np.empty((comm.Get_size(), fused.size), np.uint16)  # MPI has no float16: its bits
            comm.Allgather(fused.astype(np.float16).view(np.uint16), gathered)
            return gathered.view(np.float16).astype(np.float32).sum(axis=0)
        layout = GradientLayout([(e.key, (e.size,), "float32") for e in entries])
        pipelines = self.pipelines[choice]
        if exchange not in pipelines:
            algorithm = self.algorithms[choice]
            pipelines[exchange] = LayoutPipeline(
                lambda lay, a=algorithm: a.make_pipeline(lay.n, self.comm, layout=lay))
            saved = self._saved.get(choice, {}).pop(exchange, None)
            if saved is not None:
                pipelines[exchange].load_state_dict(saved)
        return np.asarray(pipelines[exchange].for_layout(layout).step(fused, tag=layout.tag), np.float32)

    # -- the runtime's hooks ----------------------------------------------------------------
    def fit_costs(self, known, sizes):
        """MPI's Allreduce at a few sizes, each candidate's numpy pipeline on copies of the first
        values of the step's gradients (throwaway pipelines); slowest rank's times."""
        comm = self.comm
        values = np.concatenate([self._values[k] for k in known if k in self._values]).astype(np.float32)
        self._values = {}
        lengths = sorted({min(m, values.size, PROBE_ELEMENTS) for m in PROBE_SIZES})
        dense = []
        for m in lengths:
            buffer, total = np.zeros(m, np.float32), np.empty(m, np.float32)
            dense.append((4 * m, time_collective(comm, lambda b=buffer, t=total: comm.Allreduce(b, t), repeats=2)))
        fitted = {}
        for spec, algorithm in self.algorithms.items():
            points = []
            for m in lengths:
                pipeline, data = algorithm.make_pipeline(m, comm), values[:m].copy()
                points.append((4 * m, time_collective(comm, lambda p=pipeline, d=data: p.step(d), repeats=1)))
                pipeline.close()
            fitted[spec] = fit_line(points)
        return Costs(dense=fit_line(dense), candidates=fitted)

    def overlaps(self):
        return self.on_gpu

    def take_out(self, spec, keys):
        out = {}
        for pipeline in self.pipelines[spec].values():
            out.update(pipeline.take_out(keys))
        for states in self._saved.get(spec, {}).values():  # not yet remade after a resume
            out.update({k: states.pop(k) for k in keys if k in states})
        return out

    def checked_gradients(self):
        out = {}
        for pipelines in self.pipelines.values():
            for pipeline in pipelines.values():
                if pipeline.layout is not None:
                    state = pipeline.state_dict()
                    out.update({e.key: (state[e.key], self._norms[e.key])
                                for e in pipeline.layout.entries if e.key in self._norms})
        return out

    def candidate_states(self):
        out = {}
        for spec in self.algorithms:
            states = {exchange: dict(state) for exchange, state in self._saved.get(spec, {}).items()}
            states.update({exchange: p.state_dict() for exchange, p in self.pipelines[spec].items()})
            out[spec] = states
        return out

    def load_candidate_states(self, states):
        for spec in self.algorithms:
            self._saved[spec] = {tuple(exchange): dict(state) for exchange, state in states.get(spec, {}).items()}
            for exchange, pipeline in list(self.pipelines[spec].items()):
                pipeline.close()
            self.pipelines[spec] = {}

    # -- checkpointing: a step ends when the next begins, so the open step is saved too -------
    def state_dict(self):
        """As :meth:`AutoRuntime.state_dict`, with the step whose end is still to come (its
        bookkeeping runs at the next call, as it would have without the checkpoint; an
        overflowed step owes none)."""
        return {**super().state_dict(), "open_step": {} if self._overflowed else dict(self._sizes)}

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        self._sizes = dict(state_dict.get("open_step", {}))
        self._seen = set(self._sizes)
        self._overflowed, self._committed, self._verdict = False, set(), None

    def close(self):
        for pipelines in self.pipelines.values():
            for pipeline in pipelines.values():
                pipeline.close()
