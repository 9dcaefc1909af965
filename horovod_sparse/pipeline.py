"""The contract of every out-of-band pipeline, written once: :class:`Pipeline`.

An out-of-band compressor makes one pipeline per gradient buffer of ``n`` elements
(``compressor.make_pipeline(n, comm, layout)``, collective) and the frontends drive every
pipeline the same way, whatever it does inside: :class:`~horovod_sparse.sparsify.Sparsifier`
(top-k and the other sparsifiers), :class:`~horovod_sparse.quantize.QuantizedPipeline`
(the quantizers), :class:`~horovod_sparse.fft.FFTSparsifier`,
:class:`~horovod_sparse.lowrank.PowerSGDPipeline` and
:class:`~horovod_sparse.exchange.plain_sum.PlainSumPipeline` (the dense sum).

Example::

    with compressor.make_pipeline(n, comm) as pipeline:
        total = pipeline.step(grad, tag=layout.tag)  # the sum over ranks, where grad lives
        saved = pipeline.state_dict()                # numbers, strings, numpy arrays
    other = compressor.make_pipeline(n, comm)
    other.load_state_dict(saved)                     # ValueError if saved for another buffer

Also here, because the exchanges share them: :class:`ClosesOnExit` (``with`` support for
whatever owns a duplicated communicator) and :func:`check_identity` (the check that a
saved state belongs to the object loading it).
"""
import numpy as np

from horovod_sparse.ops import namespace, views


class ClosesOnExit:
    """``with obj: ...`` calls ``obj.close()`` on exit, also on errors, so the duplicated
    communicator is freed; subclasses define an idempotent ``close()``."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class Pipeline(ClosesOnExit):
    """The state of one gradient buffer of ``n`` elements on this rank, exchanged out of band.

    The contract every pipeline keeps (the frontends rely on nothing else):

    ``step(grad, tag=0, finite=True)``
        Collective: every rank of the pipeline's communicator calls it, the same number of
        times in the same order. ``grad`` is this rank's gradient, a 1-D float buffer of
        ``n`` elements (numpy, or a torch tensor on any device), only read. ``tag`` is an
        int every rank passes identically (a CRC of the gradient layout). Returns a float32
        buffer of ``n`` elements in grad's library and device: the sum over ranks of what
        the ranks contributed, bitwise identical on every rank. If the exchange raises, the
        pipeline's state is left as it was before the call. If any rank's grad (with its
        state) holds inf or NaN, or passes ``finite=False`` (another gradient of its step,
        exchanged elsewhere, did), every rank raises
        :class:`~horovod_sparse.errors.NonFiniteGradientError` and no state changes.
    ``last``
        What the latest step did on this rank (its ``step`` number and ``traffic``, plus
        what the pipeline tells of itself); None before the first step and after a load.
    ``traffic``
        Cumulative :class:`~horovod_sparse.exchange.Traffic` of the pipeline's exchanges
        on this rank.
    ``step_count``
        Steps done (restored by a load).
    ``state_dict()`` / ``load_state_dict(state)``
        This rank's state as a flat dict of numbers, strings and numpy arrays (no pickle
        needed to read it back); each rank saves and loads its own. The load refuses, with
        a ValueError naming the field, a state saved for another buffer: the identity
        fields (``format``, ``n`` and what a subclass adds) must match.
    ``close()``, ``with``
        Free the duplicated communicators (idempotent).
    ``regime()``
        What the next step does, in words, where a warm-up makes it differ from the steady
        step (:mod:`horovod_sparse.warmup`); ``"steady"`` otherwise.

    A subclass sets ``n`` and ``_exchanges`` (the objects it exchanges through, each with
    ``traffic`` and ``close()``) and writes ``step``; a pipeline with more state than its
    step counter writes :meth:`_own_state` and :meth:`_load_own_state`, and one with more
    identity than its format and ``n`` extends :meth:`_identity`.
    """

    #: version of the saved state; a state of another version is refused
    state_format = 1
    step_count = 0
    last = None
    _exchanges = ()
    #: on the CPU, torch tensors run numpy's kernels on zero-copy views (the same bits as
    #: numpy input); False runs torch's own, as on a GPU (for the pipelines computing
    #: through :meth:`_kernel`)
    numpy_on_cpu = True
    #: ``step`` returns a new buffer at every call (one the caller may keep past the next step);
    #: False where a pipeline reuses its result buffer
    fresh_result = False
    #: ``step`` also takes ``grad`` as a list of 1-D float pieces that are the buffer back to back
    #: (a step's gradients, flattened), read where they are: the frontends then skip the fused
    #: copy (:mod:`horovod_sparse.step.bucket`)
    takes_pieces = False
    _workspace = _workspace_place = None

    def step(self, grad, tag=0, finite=True):
        raise NotImplementedError

    def regime(self):
        """The next step's regime, in words (a pipeline without a warm-up: always steady)."""
        return "steady"

    @property
    def traffic(self):
        """Cumulative Traffic of this pipeline's exchanges on this rank."""
        first, *others = [exchange.traffic for exchange in self._exchanges]
        return sum(others, first)

    def close(self):
        """Free the communicators of this pipeline's exchanges (idempotent)."""
        for exchange in self._exchanges:
            exchange.close()

    # ------------------------------------------------------------ checkpoints
    def _identity(self):
        """The fields a saved state must share with this pipeline to be loaded here."""
        return {"format": self.state_format, "n": self.n}

    def _own_state(self):
        """The subclass's fields of :meth:`state_dict` (numbers, strings, numpy arrays);
        none here: a pipeline with no state but its step counter."""
        return {}

    def _load_own_state(self, state):
        """Restore the fields of :meth:`_own_state` from ``state`` (whose identity matched)."""

    def state_dict(self):
        """This rank's state: the identity fields, ``step`` and the subclass's own fields."""
        return {**self._identity(), "step": self.step_count, **self._own_state()}

    def load_state_dict(self, state):
        """Restore :meth:`state_dict` (saved on this rank for the same buffer and parameters)."""
        check_identity(state, self._identity(), type(self).__name__)
        self._load_own_state(state)
        self.step_count = int(state["step"])
        self.last = None

    # ------------------------------------------------------- device workspace
    def _kernel(self, x):
        """``x`` in the library whose kernels run on it (:func:`~horovod_sparse.ops.views.kernel_view`)."""
        return views.kernel_view(x, self.numpy_on_cpu)

    def _workspace_for(self, like):
        """This pipeline's scratch buffers for a gradient like ``like``, made by
        :meth:`_new_workspace` once per library, device and kernel choice."""
        place = (namespace.is_torch(like), str(getattr(like, "device", "")), bool(self.numpy_on_cpu))
        if self._workspace is None or self._workspace_place != place:
            self._workspace, self._workspace_place = self._new_workspace(like), place
        return self._workspace

    def _new_workspace(self, like):
        raise NotImplementedError


def check_identity(state, expected, owner):
    """Raise ValueError unless the saved ``state`` has every field of ``expected`` with the
    same value (numbers compare as numbers: numpy scalars read back from a file match).

    Example: ``check_identity(saved, {"format": 1, "n": 10}, "Sparsifier")``.
    """
    for key, mine in expected.items():
        saved = _plain(state.get(key))
        if not _same(saved, mine):
            raise ValueError(f"state_dict has {key}={saved!r}, this {owner} has {key}={mine!r} "
                             "(saved with another configuration)")


def saved_array(state, key, shape, dtype=np.float32):
    """``state[key]`` as a numpy array of ``dtype``; ValueError unless it has ``shape``."""
    array = np.asarray(state[key], dtype)
    if array.shape != tuple(shape):
        raise ValueError(f"state_dict {key} has shape {array.shape}, expected {tuple(shape)}")
    return array


def with_prefix(prefix, state):
    """``state``'s fields renamed ``prefix + field`` (a part's state inside its owner's)."""
    return {prefix + key: value for key, value in state.items()}


def without_prefix(state, prefix):
    """The fields of ``state`` starting with ``prefix``, the prefix removed."""
    return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}


def engine_state(prefix, engine):
    """A :class:`~horovod_sparse.exchange.SparseAllreduce`'s state under ``prefix``, its
    algorithm saved as its code (an int)."""
    state = dict(engine.state_dict())
    state["algorithm"] = engine.algorithms.index(state["algorithm"])
    return with_prefix(prefix, state)


def load_engine_state(engine, state, prefix):
    """Restore into ``engine`` what :func:`engine_state` saved in ``state`` under ``prefix``."""
    saved = without_prefix(state, prefix)
    code = _plain(saved.get("algorithm", -1))
    known = isinstance(code, (int, np.integer)) and 0 <= code < len(engine.algorithms)
    saved["algorithm"] = engine.algorithms[code] if known else code
    engine.load_state_dict(saved)


def _plain(value):
    """A numpy scalar (or 0-d array) as the Python number or string it holds."""
    return value.item() if isinstance(value, (np.generic, np.ndarray)) and np.ndim(value) == 0 else value


def _same(saved, mine):
    try:
        return np.ndim(saved) == 0 and bool(saved == mine)
    except (TypeError, ValueError):
        return False
