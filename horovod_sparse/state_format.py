"""The one format of a compressor's saved state, for both frontends and every mechanism.

``compression.state_dict()`` returns a *state tree*: dicts (keyed by str, int, or tuples
of those: a gradient's name, its position, a TensorFlow group of names), lists, numbers
(Python or numpy scalars), strings, None, and numeric numpy arrays. Nothing else: no
tensors, no objects, so a checkpoint never needs pickle to be read back, and what
:mod:`horovod_sparse.checkpoint` sends between ranks is plain bytes.

:func:`encode` turns a tree into bytes (an ``.npz`` holding the arrays, and a JSON
manifest of the structure whose arrays are referred to by number); :func:`decode` gives
the same tree back, every array and numpy scalar with its dtype and bits. :func:`check`
names the first leaf that is none of the above.

Example::

    blob = encode({"fc.weight": {"residual": np.zeros(3, np.float32), "step": 4}})
    assert decode(blob)["fc.weight"]["step"] == 4
"""
import io
import json
import numbers

import numpy as np

#: the format's version, saved with every checkpoint (1: flat {key: {field: leaf}}, no lists)
FORMAT = 2


def check(tree, path="state"):
    """Raise ValueError naming ``path`` of the first leaf that is not part of the format."""
    if isinstance(tree, dict):
        for key, value in tree.items():
            _check_key(key, path)
            check(value, f"{path}[{key!r}]")
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            check(value, f"{path}[{i}]")
    elif isinstance(tree, np.ndarray) or isinstance(tree, np.generic):
        if np.asarray(tree).dtype.kind not in "biuf":
            raise ValueError(f"{path}: a compressor state holds numeric arrays only, got dtype {tree.dtype}")
    elif not (tree is None or isinstance(tree, (str, bool, numbers.Integral, float))):
        raise ValueError(f"{path}: a compressor state holds dicts, lists, numbers, strings and numeric "
                         f"numpy arrays only, got {type(tree).__name__}")


def _check_key(key, path):
    if isinstance(key, tuple):
        for part in key:
            _check_key(part, path)
    elif isinstance(key, bool) or not isinstance(key, (str, int)):
        raise ValueError(f"{path}: a compressor state's keys are strings, ints or tuples of them, got {key!r}")


def encode(tree):
    """The tree as bytes (a uint8 array, ready for a buffer-based MPI call). ValueError as :func:`check`."""
    check(tree)
    arrays = {}
    manifest = _to_manifest(tree, arrays)
    buffer = io.BytesIO()
    np.savez(buffer, manifest=np.frombuffer(json.dumps(manifest).encode(), np.uint8),
             **{f"a{i}": a for i, a in enumerate(arrays.values())})
    return np.frombuffer(buffer.getvalue(), np.uint8)


def decode(blob):
    """The tree :func:`encode` made of ``blob`` (bytes or a uint8 array); ValueError if it is not one."""
    try:
        with np.load(io.BytesIO(np.ascontiguousarray(blob).tobytes()), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        manifest = json.loads(arrays.pop("manifest").tobytes().decode())
        return _from_manifest(manifest, arrays)
    except ValueError:
        raise
    except Exception as e:  # a zip, JSON or key error: the bytes are not a saved state
        raise ValueError(f"not a compressor state in format {FORMAT}: {type(e).__name__}: {e}") from None


# The manifest is JSON: lists and dicts are tagged so that keys keep their types and an
# array, or a numpy scalar, is a reference to the .npz's entry "a<i>".
def _to_manifest(node, arrays):
    if isinstance(node, dict):
        return {"dict": [[_key(k), _to_manifest(v, arrays)] for k, v in node.items()]}
    if isinstance(node, (list, tuple)):
        return {"list": [_to_manifest(v, arrays) for v in node]}
    if isinstance(node, (np.ndarray, np.generic)):
        arrays[len(arrays)] = np.asarray(node)
        return {"array" if isinstance(node, np.ndarray) else "scalar": len(arrays) - 1}
    if isinstance(node, numbers.Integral) and not isinstance(node, bool):
        return int(node)
    return node  # None, bool, float, str


def _from_manifest(node, arrays):
    if isinstance(node, dict):
        (kind, value), = node.items()
        if kind == "dict":
            return {_unkey(k): _from_manifest(v, arrays) for k, v in value}
        if kind == "list":
            return [_from_manifest(v, arrays) for v in value]
        array = arrays[f"a{value}"]
        return array.copy() if kind == "array" else array[()]
    return node


def _key(key):
    return {"tuple": [_key(k) for k in key]} if isinstance(key, tuple) else key


def _unkey(key):
    return tuple(_unkey(k) for k in key["tuple"]) if isinstance(key, dict) else key
