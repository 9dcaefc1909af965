"""Horovod jobs inside one ``mpirun -np 4``, for the tests of :mod:`horovod_sparse.world`.

Each scenario says, for every COMM_WORLD rank, the COMM_WORLD ranks of its Horovod job in
Horovod's rank order, and how that job is made (``hvd.init(comm=Split)`` or
``hvd.init(comm=[ranks])``). :func:`init_world` shuts down whichever Horovod frontend runs,
forgets the communicators mapped for it, and initialises the given frontend on the scenario's
world; the tests' own oracle communicator of that world is a Split made here, independent of
the module under test.

Example::

    world = init_world(hvd, "split 2+2")
    world.comm.Get_size() == hvd.size() == 2
"""
import sys
from dataclasses import dataclass

import numpy as np
from horovod.common import process_sets
from mpi4py import MPI

from horovod_sparse import world as horovod_world

CW = MPI.COMM_WORLD

#: scenario -> (how Horovod is initialised, COMM_WORLD rank -> its job's COMM_WORLD ranks in Horovod's order)
SCENARIOS = {
    "split 2+2": ("split", lambda r: [0, 1] if r < 2 else [2, 3]),
    "split 3+1": ("split", lambda r: [0, 1, 2] if r < 3 else [3]),
    "ranks [3,1,2]+[0]": ("ranks", lambda r: [0] if r == 0 else [3, 1, 2]),
    # every process in one job, in reverse order: Horovod's world is all of COMM_WORLD, but not its order
    "reversed 4": ("split", lambda r: [3, 2, 1, 0]),
}
#: the scenarios where Horovod holds a part of COMM_WORLD
SUB_WORLDS = ["split 2+2", "split 3+1", "ranks [3,1,2]+[0]"]


@dataclass
class World:
    name: str
    members: list        # COMM_WORLD ranks of this rank's Horovod job, in Horovod's order
    comm: MPI.Comm        # the tests' own communicator of those ranks, in that order
    process_set: object   # a Horovod process set of Horovod ranks [0, 2] in worlds of 3 ranks, else None


_CURRENT = {}  # "world": the World now initialised, "hvd": its frontend
_LISTED = set()  # frontends once initialised with a list of ranks


def init_world(hvd, name):
    """Horovod's frontend ``hvd`` initialised on the scenario ``name``'s world (once: the same
    call again returns the same World). Collective over COMM_WORLD."""
    if _CURRENT.get("hvd") is hvd and _CURRENT["world"].name == name:
        return _CURRENT["world"]
    shutdown()
    how, members_of = SCENARIOS[name]
    rank = CW.Get_rank()
    members = members_of(rank)
    sets = [hvd.ProcessSet([0, 2])] if len(members) == 3 else []
    # Horovod 0.28.1 keeps one table of process sets per process, bound to the frontend imported
    # last; hvd.init reads it before rebinding it: bind it to this frontend first, or a
    # TensorFlow job in a process that also imported horovod.torch sees itself in no process set
    # (and its tape reduces nothing)
    process_sets._setup(sys.modules[hvd.__name__ + ".mpi_ops"]._basics)
    if how == "split" and hvd not in _LISTED:
        hvd.init(comm=CW.Split(color=min(members), key=members.index(rank)), process_sets=sets)
    else:  # the same world as a list; Horovod 0.28.1 keeps the list through shutdown (conftest runs these last)
        hvd.init(comm=members, process_sets=sets)
        _LISTED.add(hvd)
    assert (hvd.size(), hvd.rank()) == (len(members), members.index(rank)), (name, hvd.size(), hvd.rank(), members)
    comm = CW.Split(color=min(members), key=members.index(rank))
    _CURRENT.update(hvd=hvd, world=World(name, members, comm, sets[0] if sets else None))
    return _CURRENT["world"]


def shutdown():
    """Every initialised Horovod frontend shut down, and the communicators mapped for it freed
    (collective over COMM_WORLD)."""
    for module in ("horovod.torch", "horovod.tensorflow"):
        frontend = sys.modules.get(module)
        if frontend is not None and frontend.is_initialized():
            frontend.shutdown()
    horovod_world.forget()
    if "world" in _CURRENT:
        _CURRENT.pop("world").comm.Free()
        _CURRENT.pop("hvd")
    CW.Barrier()


def average(comm, array):
    """The average over ``comm`` of a float array, by an independent Allreduce in float64."""
    local = np.asarray(array, np.float64)
    total = np.empty_like(local)
    comm.Allreduce(local, total)
    return total / comm.Get_size()


def assert_identical(comm, array):
    """``array`` is bitwise the same on every rank of ``comm``."""
    local = np.ascontiguousarray(array).view(np.uint8).ravel()
    gathered = np.empty((comm.Get_size(), local.size), np.uint8)
    comm.Allgather(local, gathered)
    differing = [r for r in range(comm.Get_size()) if not np.array_equal(gathered[r], gathered[0])]
    assert not differing, f"rank(s) {differing} of the world differ from its rank 0"


def assert_horovod_equal(comm, ours, horovods):
    """Ours equals Horovod's own dense result: bit for bit on up to 2 ranks; from 3, Horovod's
    allreduce fuses and orders its sum otherwise than MPI's over our buffer, so within float32
    rounding (far below the 0.02 a sum over another world makes)."""
    if comm.Get_size() <= 2:
        np.testing.assert_array_equal(ours, horovods)
    else:
        np.testing.assert_allclose(ours, horovods, rtol=1e-5, atol=1e-6)
