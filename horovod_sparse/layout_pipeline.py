"""The pipeline of a fused step whose set of gradients can change (a layer frozen or
unfrozen mid-training), with each gradient's state following that gradient.

A pipeline's ``state_dict`` holds per-element arrays of its buffer's length n (the
residual, DGC's velocity, Signum's momentum) and whole-buffer state (step counter,
carried threshold, the exchange's call counter and regions, PowerSGD's warm-start Q's).
When the layout changes, the per-element arrays are cut by gradient and kept under each
gradient's key; the pipeline made for the new layout takes its gradients' slices back
and the step counter, and starts its other state afresh (identically on every rank).
The slices of gradients that left the layout are kept, untouched, until they return:
a frozen layer resumes with the residual it had.

Example::

    pipelines = LayoutPipeline(lambda layout: algorithm.make_pipeline(layout.n, comm, layout=layout))
    summed = pipelines.for_layout(layout).step(flat, tag=layout.tag)
"""
import numpy as np

from horovod_sparse.agreement import raise_on_every_rank

#: whole-buffer state that carries over to a new layout
CARRIED = ("step",)
#: prefixes of an exchange's own state: its arrays are per chunk or region, not per element
_EXCHANGE_PREFIXES = ("engine_", "dense_engine_", "exchange_")
#: key of the whole-buffer state in :meth:`LayoutPipeline.state_dict` (not a parameter name)
PIPELINE_KEY = "(fused)"


def per_element_fields(state, n):
    """The fields of a pipeline's ``state`` that hold one value per buffer element."""
    return [field for field, value in state.items()
            if not field.startswith(_EXCHANGE_PREFIXES) and np.shape(value) == (n,) and np.ndim(value) == 1]


def cut(layout, state):
    """``({gradient key: {field: its slice}}, whole-buffer state)`` of a pipeline's ``state``."""
    fields = per_element_fields(state, layout.n)
    slices = {entry.key: {field: np.array(state[field][entry.offset:entry.offset + entry.size])
                          for field in fields} for entry in layout.entries}
    return slices, {field: value for field, value in state.items() if field not in fields}


class LayoutPipeline:
    """The pipeline of the current layout, made by ``make(layout)``, rebuilt when the layout
    changes (the caller makes every rank change at the same step: it is collective).

    Attributes: ``layout`` and ``pipeline`` (None before the first step), ``kept``
    (``{gradient key: {field: slice}}`` of the gradients outside the current layout).
    """

    def __init__(self, make):
        self.make = make
        self.layout = self.pipeline = None
        self.kept = {}
        self._saved = None  # whole-buffer state loaded before the pipeline existed

    def is_current(self, layout):
        """True if :meth:`for_layout` would return the current pipeline (no new one, no state moved)."""
        return self.pipeline is not None and (self.layout is layout or self.layout == layout)

    def for_layout(self, layout):
        """The pipeline exchanging ``layout``: the current one, or a new one that takes over
        the state of the gradients it shares with the previous layout. If the new one cannot
        take that state (ValueError), no state is lost: it stays kept for the next try."""
        if self.is_current(layout):
            return self.pipeline
        saved, self._saved = self._saved, None
        if self.pipeline is not None:
            slices, saved = cut(self.layout, self.pipeline.state_dict())
            self.kept.update(slices)
            self.close()
        self.layout, self.pipeline = None, None  # until the new one holds its state (loading may raise)
        pipeline = self.make(layout)
        try:
            self._install(layout, pipeline, pipeline.state_dict(), saved,
                          describe=None if saved is None else saved.get("layout"))
        except Exception:
            self._saved = saved
            pipeline.close()
            raise
        self.layout, self.pipeline = layout, pipeline
        return pipeline

    def for_layout_on_every_rank(self, layout, comm, name):
        """:meth:`for_layout`, collective on ``comm`` when it makes a new pipeline: a rank that
        cannot take the gradients' state makes every rank raise the same ValueError (prefixed
        ``name``), so none is left waiting in the exchange. The ranks must have agreed on
        ``layout`` first (:func:`~horovod_sparse.agreement.agree_on_layout`)."""
        if self.is_current(layout):
            return self.pipeline
        pipeline, problem = None, None
        try:
            pipeline = self.for_layout(layout)
        except ValueError as e:
            problem = f"{name}: {e}"
        raise_on_every_rank(comm, problem)
        return pipeline

    def _install(self, layout, pipeline, base, saved, describe=None):
        """Load into ``pipeline`` its base state, with ``saved``'s whole-buffer state (all of it
        if saved for this very layout, else its step counter) and its gradients' kept slices."""
        state = dict(base)
        if saved is not None:
            same = describe == layout.describe()
            state.update({field: value for field, value in saved.items()
                          if field != "layout" and (same or field in CARRIED)})
        missing = [e.key for e in layout.entries if e.key in self.kept and
                   any(np.shape(v) != (e.size,) for v in self.kept[e.key].values())]
        if missing:
            raise ValueError(f"the kept state of gradient(s) {missing} does not fit their size in "
                             f"[{layout.describe()}]: a parameter changed shape")
        for field in per_element_fields(state, layout.n):
            array = np.array(state[field], copy=True)
            for entry in layout.entries:
                part = self.kept.get(entry.key, {}).get(field)
                if part is not None:
                    array[entry.offset:entry.offset + entry.size] = part
            state[field] = array
        pipeline.load_state_dict(state)
        for entry in layout.entries:
            self.kept.pop(entry.key, None)

    def take_out(self, keys):
        """``{key: {field: slice}}`` of the gradients ``keys`` that this pipeline holds, removed
        from it for good (they move to another compressor, which takes what it can use). The
        pipeline of the remaining gradients is made anew at its next step, with their state
        and the step counter."""
        if self.pipeline is not None and any(e.key in keys for e in self.layout.entries):
            slices, whole = cut(self.layout, self.pipeline.state_dict())
            self.kept.update(slices)
            self.close()
            self.layout, self.pipeline = None, None
            self._saved = {field: value for field, value in whole.items() if field in CARRIED}
        return {key: self.kept.pop(key) for key in keys if key in self.kept}

    # -- checkpointing ------------------------------------------------------------------
    def state_dict(self):
        """``{gradient key: {field: slice}}`` for every gradient seen, plus the whole-buffer
        state (with its layout, described) under :data:`PIPELINE_KEY`."""
        out = {key: dict(fields) for key, fields in self.kept.items()}
        if self.pipeline is not None:
            slices, whole = cut(self.layout, self.pipeline.state_dict())
            out.update(slices)
            out[PIPELINE_KEY] = dict(whole, layout=self.layout.describe())
        elif self._saved is not None:
            out[PIPELINE_KEY] = dict(self._saved)
        return out

    def load_state_dict(self, state_dict):
        """Restore :meth:`state_dict`: into the current pipeline, or at the first step."""
        saved = state_dict.get(PIPELINE_KEY)
        self.kept.update({key: dict(fields) for key, fields in state_dict.items() if key != PIPELINE_KEY})
        if self.pipeline is None:
            self._saved = None if saved is None else dict(saved)
            return
        self._install(self.layout, self.pipeline, self.pipeline.state_dict(), saved,
                      describe=None if saved is None else saved.get("layout"))

    def close(self):
        if self.pipeline is not None:
            self.pipeline.close()
