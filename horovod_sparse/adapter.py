"""What the PyTorch, TensorFlow and numpy frontends share: binding a compressor's math
to one framework's ops and to the per-tensor state.

A frontend subclass decides only how a gradient is identified (its slot key), since
Horovod's ``compress(tensor)`` carries no name; everything else is here.
"""
import inspect

from horovod_sparse import registry
from horovod_sparse.agreement import check_same_on_every_rank, communicator_of
from horovod_sparse.compressors.base import WIRE_DTYPE
from horovod_sparse.horovod_frames import caller_process_set
from horovod_sparse.state import CompressorState


class CompressorAdapter:
    """A framework-free compressor bound to ``ops``, with its state.

    Attributes:
        algorithm: the :class:`~horovod_sparse.compressors.Compressor` doing the math.
        state: the :class:`~horovod_sparse.state.CompressorState` (one slot per gradient).
    """

    ops = None  # an ArrayOps instance, set by each frontend

    def __init__(self, algorithm):
        self.algorithm = algorithm
        self.state = CompressorState()
        self._pending = {}  # slot key -> (residual, step) loaded before the slot existed
        self._agreed = False  # parameters checked across ranks (once, at the first compress)

    @classmethod
    def from_spec(cls, spec, **params):
        """Build from a spec string, e.g. ``from_spec("randomk:density=0.01")``."""
        return cls(registry.create(spec, **params))

    def compress_slot(self, tensor, key):
        """Compress ``tensor`` as the gradient identified by ``key``; returns ``(payload, ctx)``."""
        ops = self.ops
        if not self._agreed:
            self.agree_across_ranks()
            self._agreed = True
        if key is None:  # no identity for this gradient: only stateless compressors can run
            return self.algorithm.compress(ops, tensor, None)
        dtype = ops.dtype_name(tensor)
        # A stateless compressor has nothing to mix up when the order of gradients changes
        # (a parameter without a gradient this step, synchronize() then step()): its slot
        # only counts bytes, so it is replaced instead of checked.
        slot = self.state.get(key, ops.shape(tensor), dtype, replace=not self.algorithm.stateful)
        if self.algorithm.stateful and slot.residual is None:
            ops.init_slot(slot, WIRE_DTYPE.get(dtype, dtype), like=tensor)
            if key in self._pending:
                ops.load_slot(slot, *self._pending.pop(key))
        payload, ctx = self.algorithm.compress(ops, tensor, slot)
        slot.payload_nbytes = ops.nbytes(payload)
        slot.dense_nbytes = ops.nbytes(tensor)
        return payload, ctx

    def agree_across_ranks(self):
        """Check once, on the ranks of the caller's process set, that all pass this compressor."""
        check_same_on_every_rank(self.algorithm.spec, communicator_of(caller_process_set()),
                                 "compressors or parameters")

    def decompress(self, tensor, ctx):
        """The gradient from a reduced payload (Horovod's ``decompress``)."""
        return self.algorithm.decompress(self.ops, tensor, ctx)

    # -- checkpointing ---------------------------------------------------------------
    def state_dict(self):
        """Residuals and step counters as ``{slot key: {"residual": ndarray, "step": int}}``.

        Save it beside the optimizer's state (``torch.save({"optimizer": opt.state_dict(),
        "compression": compression.state_dict()}, path)``); each rank saves its own,
        since residuals differ across ranks.
        """
        out = {}
        for key, slot in self.state.slots.items():
            if slot.residual is None:
                continue
            residual, step = self.ops.slot_to_numpy(slot)
            out[key] = {"residual": residual, "step": step}
        return out

    def load_state_dict(self, state_dict):
        """Restore what :meth:`state_dict` returned; slots not yet created are restored on first use."""
        for key, entry in state_dict.items():
            slot = self.state.slots.get(key)
            if slot is not None and slot.residual is not None:
                self.ops.load_slot(slot, entry["residual"], entry["step"])
            else:
                self._pending[key] = (entry["residual"], entry["step"])

    # -- accounting --------------------------------------------------------------------
    @property
    def payload_bytes_per_step(self):
        """Bytes this rank hands to the allreduce per step, summed over gradients."""
        return self.state.payload_bytes_per_step

    @property
    def dense_bytes_per_step(self):
        """Bytes the same gradients take uncompressed."""
        return self.state.dense_bytes_per_step

    def bytes_sent_per_step(self, world_size):
        """Bytes this rank sends per step if Horovod's allreduce is a ring: 2(P-1)/P x payload."""
        from horovod_sparse.out_of_band import ring_bytes
        return ring_bytes(self.payload_bytes_per_step, world_size)

    def __repr__(self):
        return f"{type(self).__name__}({self.algorithm.spec!r})"


#: parameters of the frontends' out-of-band compressor classes, not of the algorithm
OUT_OF_BAND_PARAMETERS = ("dense_below", "schedule", "profile_steps", "trial_steps")


def make_compression_namespace(adapter_cls, sparse_cls, doc):
    """A ``Compression`` class for one frontend: one factory per registered compressor.

    ``Compression.randomk(density=0.01)`` returns ``adapter_cls(RandomKCompressor(density=0.01))``;
    out-of-band ones (``algorithm.out_of_band``) get ``sparse_cls(algorithm, dense_below=..., schedule=...)``
    instead (:data:`OUT_OF_BAND_PARAMETERS`).
    Each call makes a new instance (use one per optimizer).
    ``Compression.from_spec("topk:density=0.01")`` and ``Compression.available()`` do the same by name.
    """
    def build(name, **params):
        # the frontend's own parameters, for the out-of-band compressors only
        own = {key: params.pop(key) for key in OUT_OF_BAND_PARAMETERS if key in params}
        algorithm = registry.create(name, **params)
        if getattr(algorithm, "out_of_band", False):
            unsupported = sorted(set(own) - set(inspect.signature(sparse_cls.__init__).parameters))
            if unsupported:
                raise ValueError(f"{name}: parameter {unsupported[0]!r} is not supported by {sparse_cls.__name__} "
                                 "(schedules run in the PyTorch frontend only)")
            return sparse_cls(algorithm, **own)
        if own:
            raise ValueError(f"{name} has no parameter {sorted(own)[0]!r} (only the out-of-band compressors "
                             "do: sparsifiers, quantizers, powersgd, fft, dense)")
        return adapter_cls(algorithm)

    def from_spec(spec, **params):
        name, spec_params = registry.parse_spec(spec)
        return build(name, **{**spec_params, **params})

    namespace = {"__doc__": doc, "available": staticmethod(registry.available),
                 "from_spec": staticmethod(from_spec)}
    for name in registry.available():
        namespace[name] = CompressorFactory(build, name)
    return type("Compression", (), namespace)


class _CompressorDoc:
    """``Compression.<name>.__doc__`` is that compressor's own docstring, looked up when asked
    for: making the ``Compression`` namespace imports no compressor module (nor mpi4py)."""

    def __get__(self, factory, owner):
        return owner._class_doc if factory is None else registry.get(factory.name).__doc__


class CompressorFactory:
    """``Compression.<name>``: call it to make a compressor, ``Compression.topk(density=0.01)``.

    Horovod users pass its own compressors uncalled (``compression=hvd.Compression.fp16``).
    The stateless ones here work the same way (one shared default instance does the work);
    a compressor with per-optimizer state (residuals, seeds, exchanges) must be made by a
    call, and used uncalled it fails at its first ``compress`` with a message that says so.

    Example::

        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvds.Compression.fp16)       # like Horovod's
        opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                       compression=hvds.Compression.topk(density=0.01))
    """

    _class_doc = __doc__
    __doc__ = _CompressorDoc()

    def __init__(self, build, name):
        self._build, self.name = build, name
        self._shared = None  # the default instance of a stateless compressor, made on first use

    def __call__(self, **params):
        return self._build(self.name, **params)

    def _uncalled(self):
        cls = registry.get(self.name)
        if cls.stateful or getattr(cls, "out_of_band", False):
            example = ", ".join(f"{p.name}={p.default!r}" for p in
                                list(inspect.signature(cls.__init__).parameters.values())[1:2])
            raise TypeError(f"Compression.{self.name} was passed without calling it: it keeps state per "
                            f"optimizer, so make one with a call, e.g. compression=Compression.{self.name}({example})")
        if self._shared is None:
            self._shared = self()
        return self._shared

    def compress(self, tensor, *args, **kwargs):
        return self._uncalled().compress(tensor, *args, **kwargs)

    def decompress(self, tensor, ctx, *args, **kwargs):
        return self._uncalled().decompress(tensor, ctx, *args, **kwargs)

    def __repr__(self):
        return f"Compression.{self.name}"
