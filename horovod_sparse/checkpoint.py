"""Checkpoints the Horovod way: rank 0 saves one object, every rank resumes from it.

A compressor's state differs per rank (each rank has its own residuals), so
``compression.state_dict()`` alone would need one file per rank. :func:`gather_state`
collects every rank's state on the root into one object; :func:`scatter_state` hands
each rank its own part back on resume, bit-exact. Only buffers cross the wire: each
rank's state is serialised as ``.npz`` bytes (numpy arrays, no pickle) and moved with
``Gatherv`` / ``Scatterv``.

Example (PyTorch)::

    state = horovod_sparse.checkpoint.gather_state(compression)       # collective
    if hvd.rank() == 0:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "compression": state}, path)
    ...
    checkpoint = torch.load(path, weights_only=False) if hvd.rank() == 0 else None  # numpy inside
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    horovod_sparse.checkpoint.scatter_state(
        compression, checkpoint["compression"] if hvd.rank() == 0 else None)  # collective

A resume on a different number of ranks is refused (``ValueError`` on every rank),
since residuals belong to ranks; ``reset_on_resize=True`` starts the residuals and step
counters from zero instead.
"""
import io
import json

import numpy as np

_FORMAT = 1


def gather_state(compression, comm=None, root=0):
    """Every rank's ``compression.state_dict()`` on ``root`` as ``{"format", "world_size",
    "compressor", "ranks": [state of rank 0, ...]}``; None on the other ranks. Collective."""
    comm = _world(comm)
    blob = _encode(compression.state_dict())
    lengths = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([blob.size], np.int64), lengths)
    gathered = np.empty(int(lengths.sum()), np.uint8) if comm.Get_rank() == root else None
    comm.Gatherv(blob, (gathered, lengths) if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() != root:
        return None
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return {"format": _FORMAT, "world_size": comm.Get_size(), "compressor": repr(compression),
            "ranks": [_decode(gathered[offsets[r]:offsets[r + 1]]) for r in range(comm.Get_size())]}


def scatter_state(compression, state, comm=None, root=0, reset_on_resize=False):
    """Load rank r's part of ``state`` (what :func:`gather_state` returned, given on ``root``;
    ignored elsewhere) into ``compression`` on every rank r. Collective.

    Raises ValueError on every rank if the state is malformed or was saved on another
    number of ranks (unless ``reset_on_resize``: then nothing is loaded and the residuals
    start from zero, on every rank)."""
    comm = _world(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    # 1. The root checks and tells everyone the outcome first, so no rank waits alone.
    status = np.zeros(2, np.int64)  # (problem code, saved world size)
    if rank == root:
        status[:] = _check(state, size)
    comm.Bcast(status, root=root)
    problem, saved_size = int(status[0]), int(status[1])
    if problem == 2 and reset_on_resize:
        return
    if problem:
        raise ValueError(
            "scatter_state: the compressor state is not one gather_state() made" if problem == 1 else
            f"scatter_state: the compressor state was saved on {saved_size} ranks, this job has {size}: "
            "residuals belong to ranks. Pass reset_on_resize=True to start them from zero instead")
    # 2. Each rank gets its own bytes.
    blobs = [_encode(part) for part in state["ranks"]] if rank == root else None
    lengths = np.array([b.size for b in blobs], np.int64) if rank == root else np.empty(size, np.int64)
    comm.Bcast(lengths, root=root)
    mine = np.empty(int(lengths[rank]), np.uint8)
    comm.Scatterv((np.concatenate(blobs), lengths) if rank == root else None, mine, root=root)
    compression.load_state_dict(_decode(mine))


def _check(state, size):
    try:
        if int(state["format"]) != _FORMAT or len(state["ranks"]) != int(state["world_size"]):
            return 1, 0
        return (0 if int(state["world_size"]) == size else 2), int(state["world_size"])
    except (KeyError, TypeError, ValueError):
        return 1, 0


def _world(comm):
    if comm is None:
        from horovod_sparse.horovod_checks import communicator_of
        comm = communicator_of(None)
    return comm


# A state_dict is {key: {field: array or number or str}}, keys being ints (positions) or
# strings: a JSON manifest records the keys and fields, the arrays go into an .npz.
def _encode(state_dict):
    manifest, arrays = [], {}
    for i, (key, entry) in enumerate(state_dict.items()):
        fields = []
        for j, (name, value) in enumerate(entry.items()):
            array_name = f"a{i}_{j}"
            arrays[array_name] = np.asarray(value)
            fields.append([name, array_name, type(value).__name__ if np.isscalar(value) else "array"])
        manifest.append([type(key).__name__, str(key), fields])
    buffer = io.BytesIO()
    np.savez(buffer, manifest=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    return np.frombuffer(buffer.getvalue(), np.uint8)


_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def _decode(blob):
    with np.load(io.BytesIO(np.ascontiguousarray(blob).tobytes()), allow_pickle=False) as npz:
        manifest = json.loads(npz["manifest"].tobytes().decode())
        out = {}
        for key_type, key, fields in manifest:
            key = int(key) if key_type == "int" else key
            out[key] = {name: (npz[array_name].copy() if kind == "array" else
                               _SCALARS.get(kind, lambda v: v)(npz[array_name].item()))
                        for name, array_name, kind in fields}
        return out
