"""The ``Compression`` catalogue each frontend exposes, as Horovod's ``hvd.Compression``:
one factory per compressor of :data:`horovod_sparse.registry.COMPRESSORS`.

    Compression = make_compression_namespace(TorchCompressor, TorchOutOfBandCompressor, doc)
    Compression.topk(density=0.01)          # a TorchOutOfBandCompressor
    Compression.fp16                        # uncalled, like hvd.Compression.fp16
"""
import inspect

from horovod_sparse import registry


#: parameters of the frontends' out-of-band compressor classes, not of the algorithm
OUT_OF_BAND_PARAMETERS = ("dense_below", "schedule", "profile_steps", "trial_steps")
#: parameters of every frontend compressor class (:mod:`horovod_sparse.nonfinite`)
FRONTEND_PARAMETERS = ("nonfinite",)


def signature_defaults(cls):
    """``{parameter: default}`` of ``cls``'s constructor, in its order (those without a default
    left out): what ``horovod-sparse list`` prints and the docs' parameter tables show.

    >>> signature_defaults(registry.get("randomk"))
    {'density': 0.01, 'error_feedback': True, 'seed': 0}
    """
    return {name: p.default for name, p in inspect.signature(cls.__init__).parameters.items()
            if name != "self" and p.default is not inspect.Parameter.empty}


def make_compression_namespace(in_band_cls, out_of_band_cls, doc, auto_cls=None):
    """A ``Compression`` class for one frontend: one factory per registered compressor.

    ``Compression.randomk(density=0.01)`` returns ``in_band_cls(RandomKCompressor(density=0.01))``;
    out-of-band ones (``algorithm.out_of_band``) get ``out_of_band_cls(algorithm, dense_below=..., schedule=...)``
    instead (:data:`OUT_OF_BAND_PARAMETERS`); every one takes ``nonfinite=`` (:data:`FRONTEND_PARAMETERS`).
    Each call makes a new instance (use one per optimizer).
    With ``auto_cls``, ``Compression.auto(...)`` (and spec ``"auto"``) makes one of those.
    ``Compression.from_spec("topk:density=0.01")`` and ``Compression.available()`` do the same by name.
    """
    def build(name, **params):
        # the frontend's own parameters, for the out-of-band compressors only
        own = {key: params.pop(key) for key in OUT_OF_BAND_PARAMETERS if key in params}
        frontend = {key: params.pop(key) for key in FRONTEND_PARAMETERS if key in params}
        algorithm = registry.create(name, **params)
        if getattr(algorithm, "out_of_band", False):
            unsupported = sorted(set(own) - set(inspect.signature(out_of_band_cls.__init__).parameters))
            if unsupported:
                raise ValueError(f"{name}: parameter {unsupported[0]!r} is not supported by {out_of_band_cls.__name__}")
            return out_of_band_cls(algorithm, **own, **frontend)
        if own:
            raise ValueError(f"{name} has no parameter {sorted(own)[0]!r} (only the out-of-band compressors "
                             "do: sparsifiers, quantizers, powersgd, fft, dense)")
        return in_band_cls(algorithm, **frontend)

    def from_spec(spec, **params):
        name, spec_params = registry.parse_spec(spec)
        if name == "auto" and auto_cls is not None:
            return auto_cls(**{**spec_params, **params})
        return build(name, **{**spec_params, **params})

    namespace = {"__doc__": doc, "available": staticmethod(registry.available),
                 "from_spec": staticmethod(from_spec)}
    for name in registry.available():
        namespace[name] = CompressorFactory(build, name)
    if auto_cls is not None:
        namespace["auto"] = CompressorFactory(lambda _, **params: auto_cls(**params), "auto", cls=auto_cls)
    return type("Compression", (), namespace)


class _CompressorDoc:
    """``Compression.<name>.__doc__`` is that compressor's own docstring, looked up when asked
    for: making the ``Compression`` namespace imports no compressor module (nor mpi4py)."""

    def __get__(self, factory, owner):
        return owner._class_doc if factory is None else factory.cls.__doc__


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

    def __init__(self, build, name, cls=None):
        self._build, self.name = build, name
        self._cls = cls  # the class it makes, where it is not the registry's (auto)
        self._shared = None  # the default instance of a stateless compressor, made on first use

    @property
    def cls(self):
        return registry.get(self.name) if self._cls is None else self._cls

    def __call__(self, **params):
        return self._build(self.name, **params)

    def _uncalled(self):
        cls = self.cls
        if getattr(cls, "stateful", True) or getattr(cls, "out_of_band", False):
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
