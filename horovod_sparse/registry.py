"""Which compressors exist, and how a spec string such as ``"randomk:density=0.01"`` makes one.

Framework-free: the frontends turn what :func:`create` returns into their own Horovod
``Compressor``. Registered classes are those of :mod:`horovod_sparse.compressors`.
"""
import inspect

_REGISTRY = {}


def register(cls):
    """Class decorator: make ``cls`` (a :class:`~horovod_sparse.compressors.Compressor`) known by ``cls.name``."""
    _REGISTRY[cls.name] = cls
    return cls


def available():
    """Sorted names of the registered compressors."""
    _load()
    return sorted(_REGISTRY)


def get(name):
    """The compressor class registered as ``name``; ValueError listing the names otherwise."""
    _load()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"compression name must be one of {available()}, got {name!r}")
    return _REGISTRY[name]


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


def _load():
    import horovod_sparse.compressors  # noqa: F401  (registers the built-in compressors)
