"""Which compressors exist, and how a spec string such as ``"randomk:density=0.01"`` makes one.

Framework-free: the frontends turn what :func:`create` returns into their own Horovod
``Compressor``. :data:`COMPRESSORS` is the table of every compressor, by name; a class is
imported when first asked for, so listing the names imports nothing.
"""
import importlib
import inspect

#: name -> "module:Class" of every compressor (the class's ``name`` is its key here).
#: Adding a compressor: write its class in :mod:`horovod_sparse.compressors`, add a line.
COMPRESSORS = {
    "none": "horovod_sparse.compressors.cast:NoneCompressor",
    "fp16": "horovod_sparse.compressors.cast:FP16Compressor",
    "randomk": "horovod_sparse.compressors.randomk:RandomKCompressor",
    "topk": "horovod_sparse.compressors.sparsifiers:TopKCompressor",
    "oktopk": "horovod_sparse.compressors.sparsifiers:OkTopKCompressor",
    "gaussiank": "horovod_sparse.compressors.sparsifiers:GaussianKCompressor",
    "threshold": "horovod_sparse.compressors.sparsifiers:ThresholdCompressor",
    "dgc": "horovod_sparse.compressors.sparsifiers:DGCCompressor",
    "gtopk": "horovod_sparse.compressors.sparsifiers:GTopKCompressor",
    "dense": "horovod_sparse.compressors.quantizers:DenseCompressor",
    "bf16": "horovod_sparse.compressors.quantizers:BF16Compressor",
    "qsgd": "horovod_sparse.compressors.quantizers:QSGDCompressor",
    "int4": "horovod_sparse.compressors.quantizers:Int4Compressor",
    "terngrad": "horovod_sparse.compressors.quantizers:TernGradCompressor",
    "signsgd": "horovod_sparse.compressors.quantizers:SignSGDCompressor",
    "signum": "horovod_sparse.compressors.quantizers:SignumCompressor",
    "efsignsgd": "horovod_sparse.compressors.quantizers:EFSignSGDCompressor",
    "onebit": "horovod_sparse.compressors.quantizers:OneBitCompressor",
    "powersgd": "horovod_sparse.compressors.powersgd:PowerSGDCompressor",
    "fft": "horovod_sparse.compressors.fft:FFTCompressor",
}


def available():
    """Sorted names of the compressors, read from :data:`COMPRESSORS` (nothing is imported).

    Example: ``"topk" in available()``.
    """
    return sorted(COMPRESSORS)


def get(name):
    """The compressor class named ``name``, imported on first use; ValueError listing the names otherwise.

    Example: ``get("topk").__name__ == "TopKCompressor"``.
    """
    if not isinstance(name, str) or name not in COMPRESSORS:
        raise ValueError(f"compression name must be one of {available()}, got {name!r}")
    module, _, cls = COMPRESSORS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def create(spec, **params):
    """A compressor from a name or spec string, plus keyword parameters.

    ``spec`` is ``"name"`` or ``"name:key=value,key=value"``; values are parsed as
    int, float, or ``true``/``false``. Keyword ``params`` override the spec's. Unknown
    names and parameters raise ValueError naming what is accepted; the compressor's
    constructor checks the values.
    """
    name, merged = parse_spec(spec)
    merged.update(params)
    cls = get(name)
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    for key in merged:
        if key not in accepted:
            raise ValueError(f"{cls.name} has no parameter {key!r}; its parameters are {accepted}")
    return cls(**merged)


def create_steady(spec, **params):
    """:func:`create`, with no warm-up (:mod:`horovod_sparse.warmup`) unless the spec or
    ``params`` name one: the steady step, which ``auto``'s candidates run (auto has its own
    warm-up) and which the step-time measurements time.

    >>> create_steady("topk:density=0.01").params["warmup_steps"]
    0
    """
    name, merged = steady_spec(spec, **params)
    return create(name, **merged)


def steady_spec(spec, **params):
    """``(name, params)`` of :func:`create_steady`: the spec's parameters, ``params``, and
    ``warmup_steps=0`` where the compressor has a warm-up and neither names it."""
    name, merged = parse_spec(spec)
    merged.update(params)
    if name in COMPRESSORS and "warmup_steps" in inspect.signature(get(name).__init__).parameters:
        merged.setdefault("warmup_steps", 0)
    return name, merged


def parse_spec(spec):
    """``"name:key=value,..."`` -> ``(name, {key: value})``, values parsed as in :func:`create`."""
    if not isinstance(spec, str):
        raise ValueError(f"compression spec must be a string like 'randomk:density=0.01', got {spec!r}")
    name, _, args = spec.partition(":")
    return name.strip(), dict(_parse_args(args, spec))


def _parse_args(args, spec):
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"compression spec {spec!r}: expected key=value, got {item!r}")
        yield key.strip(), _parse_value(raw.strip())


def _parse_value(raw):
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for convert in (int, float):
        try:
            return convert(raw)
        except ValueError:
            pass
    return raw

