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
counters from zero instead. So is a state that is not one :func:`gather_state` made, one
of another compressor, and one a rank cannot load: every rank raises the same error, and
none is left waiting in a collective. The format is :mod:`horovod_sparse.state_format`
(numbers, strings and numeric arrays; the plan of a ``schedule=`` included).
"""
import numpy as np

from horovod_sparse import state_format
from horovod_sparse.agreement import communicator_of, raise_on_every_rank

#: formats scatter_state reads: 1 (before the plan of a schedule could be saved) is a subset of 2
READABLE_FORMATS = (1, state_format.FORMAT)


def gather_state(compression, comm=None, root=0):
    """Every rank's ``compression.state_dict()`` on ``root`` as ``{"format", "world_size",
    "compressor", "algorithm", "ranks": [state of rank 0, ...]}``; None on the other ranks.
    Collective over ``comm``: by default Horovod's ranks, in Horovod's order
    (:func:`~horovod_sparse.agreement.communicator_of`; not mpi4py's ``COMM_WORLD``, of which
    Horovod may hold a part); a rank whose state cannot be saved makes every rank raise the
    same ValueError."""
    comm = communicator_of(None) if comm is None else comm
    blob, problem = np.empty(0, np.uint8), None
    try:
        blob = state_format.encode(compression.state_dict())
    except ValueError as e:
        problem = f"gather_state: {e}"
    raise_on_every_rank(comm, problem)
    lengths = np.empty(comm.Get_size(), np.int64)
    comm.Allgather(np.array([blob.size], np.int64), lengths)
    gathered = np.empty(int(lengths.sum()), np.uint8) if comm.Get_rank() == root else None
    comm.Gatherv(blob, (gathered, lengths) if comm.Get_rank() == root else None, root=root)
    if comm.Get_rank() != root:
        return None
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    return {"format": state_format.FORMAT, "world_size": comm.Get_size(), "compressor": repr(compression),
            "algorithm": _algorithm_name(compression),
            "ranks": [state_format.decode(gathered[offsets[r]:offsets[r + 1]]) for r in range(comm.Get_size())]}


def scatter_state(compression, state, comm=None, root=0, reset_on_resize=False):
    """Load rank r's part of ``state`` (what :func:`gather_state` returned, given on ``root``;
    ignored elsewhere) into ``compression`` on every rank r (Horovod's rank r, unless ``comm``
    says otherwise, as in :func:`gather_state`). Collective.

    Raises the same ValueError on every rank if the state is malformed, was saved for another
    compressor, or was saved on another number of ranks (unless ``reset_on_resize``: then
    nothing is loaded and the residuals start from zero, on every rank), or if a rank cannot
    load its part."""
    comm = communicator_of(None) if comm is None else comm
    size, rank = comm.Get_size(), comm.Get_rank()
    # 1. The root checks the whole state and encodes each rank's part; every rank hears the outcome.
    blobs, problem, resized = None, None, np.zeros(1, np.int64)
    if rank == root:
        problem, resized[0] = _check(state, size, _algorithm_name(compression))
        if problem is None:
            try:
                blobs = [state_format.encode(part) for part in state["ranks"]]
            except ValueError as e:
                problem = f"scatter_state: the compressor state is damaged: {e}"
    comm.Bcast(resized, root=root)
    if resized[0] and reset_on_resize:
        return
    raise_on_every_rank(comm, problem)
    # 2. Each rank gets its own bytes and loads them.
    lengths = np.array([b.size for b in blobs], np.int64) if rank == root else np.empty(size, np.int64)
    comm.Bcast(lengths, root=root)
    mine = np.empty(int(lengths[rank]), np.uint8)
    comm.Scatterv((np.concatenate(blobs), lengths) if rank == root else None, mine, root=root)
    problem = None
    try:
        compression.load_state_dict(state_format.decode(mine))
    except (ValueError, KeyError, TypeError) as e:
        problem = f"scatter_state: this rank's part of the compressor state cannot be loaded: {e}"
    raise_on_every_rank(comm, problem)


def _check(state, size, algorithm):
    """``(problem or None, 1 if the state is sound but saved on another number of ranks)``."""
    try:
        saved_size = int(state["world_size"])
        if int(state["format"]) not in READABLE_FORMATS or len(state["ranks"]) != saved_size:
            raise ValueError
    except (KeyError, TypeError, ValueError):
        return "scatter_state: the compressor state is not one gather_state() made", 0
    if state.get("algorithm", algorithm) != algorithm:
        return (f"scatter_state: the compressor state was saved by {state['algorithm']!r}, "
                f"this compressor is {algorithm!r}"), 0
    if saved_size != size:
        return (f"scatter_state: the compressor state was saved on {saved_size} ranks, this job has {size}: "
                "residuals belong to ranks. Pass reset_on_resize=True to start them from zero instead"), 1
    return None, 0


def _algorithm_name(compression):
    algorithm = getattr(compression, "algorithm", None)
    return getattr(algorithm, "name", type(compression).__name__)
