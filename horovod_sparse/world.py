"""Horovod's world as an mpi4py communicator.

The out-of-band exchanges run over mpi4py beside Horovod's own allreduce, so they must run
among exactly Horovod's ranks, in Horovod's rank order. mpi4py's ``COMM_WORLD`` is that
world only when Horovod was initialised on all of it, in its order (``hvd.init()`` under
``mpirun`` or ``horovodrun``). Not so:

- ``hvd.init(comm=MPI.COMM_WORLD.Split(...))`` or ``hvd.init(comm=[3, 1, 2])``: several
  Horovod jobs inside one MPI job, or Horovod's ranks in another order; a sum over
  ``COMM_WORLD`` would add the other jobs' gradients in, silently;
- ``horovodrun --gloo``, elastic Horovod: mpi4py's world is each process alone, and a sum
  over it is this rank's gradient only, silently.

:func:`horovod_world` is a private communicator of exactly Horovod's ranks (its rank r is
``hvd.rank()`` r), made once; :func:`process_set_communicator` the same for a Horovod process
set. Where Horovod's ranks are not the processes of one MPI job, the communicator is a
:class:`~horovod_sparse.horovod_collectives.HorovodCollectives`: the same calls, carried by
the frontend's own Horovod collectives (PyTorch or TensorFlow). With
``HOROVOD_SPARSE_TRANSPORT=mpi`` there, every rank raises :class:`HorovodWorldError`, which
says how to launch instead; no exchange runs on a wrong world.

The transport: ``HOROVOD_SPARSE_TRANSPORT`` (:func:`transport_setting`) is ``auto`` (default:
mpi4py where it maps Horovod's world, Horovod's collectives otherwise), ``mpi`` (mpi4py or
HorovodWorldError) or ``horovod`` (Horovod's collectives, under mpirun too: how the two are
compared on one launch). Every rank of a job must see the same value.

Example::

    hvd.init(comm=MPI.COMM_WORLD.Split(color=MPI.COMM_WORLD.rank // 2, key=MPI.COMM_WORLD.rank))
    comm = horovod_world()
    assert (comm.Get_size(), comm.Get_rank()) == (hvd.size(), hvd.rank())
"""
import atexit
import os
import sys
import threading
import zlib

import numpy as np

from horovod_sparse.errors import HorovodWorldError  # noqa: F401  (raised here; importable from here too)

#: the Horovod frontends this package runs behind, in the order they are looked for
FRONTENDS = ("horovod.torch", "horovod.tensorflow")

#: environment variables naming the MPI job a process belongs to (the same on all its ranks)
JOB_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")

#: the environment variable that picks the exchanges' transport, and its values
TRANSPORT_VARIABLE = "HOROVOD_SPARSE_TRANSPORT"
TRANSPORTS = ("auto", "mpi", "horovod")

_COMMS = {}  # (frontend or "mpi", Horovod ranks of the set or None) -> communicator


def transport_setting(environ=None):
    """``HOROVOD_SPARSE_TRANSPORT``, lower-cased: ``"auto"`` (also where unset), ``"mpi"`` or
    ``"horovod"``; ValueError for anything else (the same on every rank of a job).

    Example: ``HOROVOD_SPARSE_TRANSPORT=horovod mpirun -np 2 python train.py`` exchanges over
    Horovod's collectives although mpi4py maps Horovod's world.
    """
    value = (os.environ if environ is None else environ).get(TRANSPORT_VARIABLE, "").strip().lower() or "auto"
    if value not in TRANSPORTS:
        raise ValueError(f"{TRANSPORT_VARIABLE} must be one of {TRANSPORTS}, got {value!r}")
    return value


def mpi_world():
    """mpi4py's ``COMM_WORLD``: the MPI job this process belongs to (a function, so that a test
    can show the module another world, as ``horovodrun --gloo`` would).

    Example: ``mpi_world().Get_size()`` is 4 under ``mpirun -np 4``.
    """
    from mpi4py import MPI  # late: importing the library must not start MPI
    return MPI.COMM_WORLD


def horovod_frontend():
    """The initialised Horovod frontend module (``horovod.torch`` or ``horovod.tensorflow``),
    or None where neither is imported and initialised (the library used without Horovod).
    Only modules already imported are looked at: this imports no framework.

    Example: after ``import horovod.torch as hvd; hvd.init()``, ``horovod_frontend() is hvd``.
    """
    for name in FRONTENDS:
        module = sys.modules.get(name)
        is_initialized = getattr(module, "is_initialized", None)
        if is_initialized is not None and is_initialized():
            return module
    return None


def horovod_world():
    """A private communicator of exactly Horovod's ranks, rank r being ``hvd.rank()`` r, on the
    transport :func:`transport_setting` picks: mpi4py's, or Horovod's collectives where
    Horovod's ranks are not processes of this MPI job; without an initialised Horovod, a
    duplicate of ``COMM_WORLD``. Made once (collective over Horovod's ranks, the first time
    only); :class:`HorovodWorldError` on every rank where neither transport serves.

    Example: ``horovod_world().Get_size() == hvd.size()``.
    """
    hvd = horovod_frontend()
    key = (_name(hvd), None)
    if key not in _COMMS:
        _COMMS[key] = mpi_world().Dup() if hvd is None else _chosen(hvd, None, lambda: _world_of(hvd))
    return _COMMS[key]


def process_set_communicator(process_set=None):
    """A private mpi4py communicator of the ranks of the Horovod ``process_set`` (None or the
    global set: :func:`horovod_world`), in the set's rank order. Its ranks are Horovod's,
    mapped through Horovod's world; collective over the set's ranks only, made once per set.
    Without an initialised Horovod the set's ranks are ``COMM_WORLD``'s.

    Example: in a Horovod job of ranks 0..3, ``process_set_communicator(hvd.ProcessSet([1, 3]))``
    is, on Horovod ranks 1 and 3, a communicator of size 2 whose rank 1 is Horovod's rank 3.
    """
    hvd = horovod_frontend()
    ranks = None if process_set is None else tuple(int(r) for r in process_set.ranks)
    if ranks is None or (hvd is not None and ranks == tuple(range(hvd.size()))):
        return horovod_world()
    key = (_name(hvd), ranks)
    if key not in _COMMS:
        world = _COMMS.get((_name(hvd), None))
        if hvd is None:
            _COMMS[key] = _create(mpi_world(), ranks)
        elif world is not None and not getattr(world, "point_to_point", True):  # Horovod's collectives
            _COMMS[key] = _collectives(hvd, process_set, world.reason)
        elif world is not None:
            _COMMS[key] = _create(world, ranks)
        else:  # Horovod's world is not mapped yet, and only the set's ranks are here: ask Horovod over the set
            _COMMS[key] = _chosen(hvd, process_set, lambda: _set_of(hvd, process_set, len(ranks)))
    return _COMMS[key]


def forget():
    """Free every communicator made here, so that the next call maps Horovod's world again:
    for a Horovod initialised anew (``hvd.shutdown()``, then ``hvd.init(comm=...)``).
    Collective, like ``MPI_Comm_free``: every rank that made them calls it.

    Example: ``hvd.shutdown(); forget(); hvd.init(comm=[0, 2])``.
    """
    from mpi4py import MPI
    while _COMMS:
        _, comm = _COMMS.popitem()
        if comm is not MPI.COMM_NULL and comm != MPI.COMM_NULL:
            comm.Free()


def _name(hvd):
    return "mpi" if hvd is None else hvd.__name__


def _chosen(hvd, process_set, mpi_communicator):
    """The transport's communicator of the set's ranks (None: Horovod's world): mpi4py's
    (``mpi_communicator()``) unless ``HOROVOD_SPARSE_TRANSPORT`` is ``horovod``, or is ``auto``
    and mpi4py cannot map Horovod's ranks (HorovodWorldError, raised on every rank alike);
    then Horovod's collectives. With ``mpi``, that HorovodWorldError."""
    transport = transport_setting()
    if transport == "horovod":
        return _collectives(hvd, process_set, f"{TRANSPORT_VARIABLE}=horovod")
    try:
        comm = mpi_communicator()
    except HorovodWorldError as error:
        if transport == "mpi":
            raise HorovodWorldError(f"{error} ({TRANSPORT_VARIABLE}=mpi)") from None
        why = "gloo launch" if hvd.gloo_enabled() else "Horovod's ranks are not one MPI job's"
        return _collectives(hvd, process_set, why)
    _meet_at_exit(hvd, process_set)
    return comm


#: how long a rank at its program's end waits for the others (s): ranks of a job that ends
#: well arrive within a step of each other; past it (a rank stuck or gone) each goes on alone
EXIT_MEETING_S = 30.0

_MEETING = []  # the process set this process meets at exit, once registered


def _meet_at_exit(hvd, process_set):
    """At the program's end, before Horovod shuts down (``atexit`` runs last-registered first,
    and Horovod registered at ``hvd.init()``), wait until every rank of the set has ended its
    program too: one Horovod allgather, on a thread, for at most EXIT_MEETING_S.

    Why: the first rank to shut Horovod down shuts it down everywhere, and where Horovod
    started MPI it finalises MPI on every rank from its own thread, while a slower rank may
    still be inside the last step's mpi4py exchange (a segfault, or an abort "called after
    MPI_FINALIZE"). Horovod's own collective is the meeting point because it is carried by
    Horovod's thread: a rank waiting in it makes no MPI call, and its Horovod finishes the
    allgather before it takes the shutdown in. A program ending on an uncaught exception
    does not wait (the others are not coming; its exit ends the job)."""
    if not _MEETING:
        _MEETING.append(process_set)
        atexit.register(_wait_for_every_rank, hvd, process_set)


def _wait_for_every_rank(hvd, process_set):
    if hasattr(sys, "last_value") or not hvd.is_initialized():  # failed, or Horovod already shut down
        return

    def allgather():
        try:
            _horovod_allgather(hvd, [hvd.rank()], process_set, "horovod_sparse.exit")
        except Exception:  # noqa: BLE001  (a peer gone or Horovod shut down: nothing to wait for)
            pass

    meeting = threading.Thread(target=allgather, name="horovod_sparse exit meeting", daemon=True)
    meeting.start()
    meeting.join(EXIT_MEETING_S)


def _collectives(hvd, process_set, reason):
    """Horovod's collectives among the set's ranks, in the frontend's own (PyTorch or TensorFlow)."""
    from horovod_sparse.horovod_collectives import HorovodCollectives
    return HorovodCollectives(hvd, process_set, reason)


def _set_of(hvd, process_set, count):
    """The set's ranks as an mpi4py communicator, when Horovod's world is not mapped yet."""
    _refuse_larger_than_mpi(hvd)
    return _create(mpi_world(), _mpi_ranks(hvd, process_set, count))


def _world_of(hvd):
    """Horovod's world: a Split of mpi4py's world when Horovod holds every MPI process, else
    the group of the MPI ranks Horovod's own allgather names."""
    mpi = mpi_world()
    size, rank = hvd.size(), hvd.rank()
    _refuse_larger_than_mpi(hvd)
    if size < mpi.Get_size():
        return _create(mpi, _mpi_ranks(hvd, None, size))
    comm = mpi.Split(0, key=rank)  # every MPI process is in this Horovod job: all call it
    # Each rank checks the same table: the Split's order is Horovod's only if the keys were
    # Horovod's ranks 0..P-1 of one job (they are not if the MPI processes are not Horovod's).
    table = _allgather(comm, [rank, size])
    if not (np.array_equal(table[:, 0], np.arange(size)) and np.all(table[:, 1] == size)):
        comm.Free()
        raise HorovodWorldError(_launch_hint(
            f"mpi4py's world has {size} processes like Horovod, but they are not Horovod's ranks "
            f"0..{size - 1} of one Horovod job"))
    return comm


def _refuse_larger_than_mpi(hvd):
    """Raise where Horovod has more ranks than mpi4py's world (a gloo or elastic launch): each
    rank concludes it alone, from sizes that are the same on every rank of the job."""
    size, mpi_size = hvd.size(), mpi_world().Get_size()
    if size > mpi_size:
        raise HorovodWorldError(_launch_hint(
            f"Horovod has {size} ranks but mpi4py's world only {mpi_size} process(es): Horovod was "
            "not launched through MPI"))


def _mpi_ranks(hvd, process_set, count):
    """The ``COMM_WORLD`` ranks of the set's (None: the world's) Horovod ranks, in Horovod's
    order: one Horovod allgather, over the set, of each rank's (MPI rank, MPI size, MPI job).
    Every rank checks the same table, so all go on or all raise."""
    mpi = mpi_world()
    name = f"horovod_sparse.world.{getattr(process_set, 'process_set_id', 0)}"
    table = _horovod_allgather(hvd, [mpi.Get_rank(), mpi.Get_size(), _job_fingerprint()], process_set, name)
    ranks, sizes, jobs = table[:, 0], table[:, 1], table[:, 2]
    problem = None
    if table.shape[0] != count:
        problem = f"Horovod's allgather returned {table.shape[0]} ranks, not {count}"
    elif np.any(jobs != jobs[0]) or np.any(sizes != sizes[0]):
        problem = "Horovod's ranks belong to different MPI jobs"
    elif np.unique(ranks).size != ranks.size or np.any(ranks < 0) or np.any(ranks >= sizes[0]):
        problem = f"Horovod's ranks are MPI ranks {ranks.tolist()} of an MPI world of {sizes[0]}, not distinct ones"
    if problem is not None:
        raise HorovodWorldError(_launch_hint(problem))
    return [int(r) for r in ranks]


def _horovod_allgather(hvd, row, process_set, name):
    """Every rank's ``row`` (ints) as an int64 array, row i from the set's rank i: Horovod's own
    allgather under ``name`` (eager in TensorFlow, lifted out of any trace)."""
    process_set = hvd.global_process_set if process_set is None else process_set
    if hvd.__name__ == "horovod.torch":
        import torch
        return hvd.allgather(torch.tensor([row], dtype=torch.int64), name=name, process_set=process_set).numpy()
    import tensorflow as tf
    with tf.init_scope():
        if not tf.executing_eagerly():
            raise HorovodWorldError(_launch_hint(
                "Horovod's world is a part of mpi4py's, and a TensorFlow graph without eager "
                "execution cannot run the allgather that maps it"))
        return hvd.allgather(tf.constant([row], tf.int64), name=name, process_set=process_set).numpy()


def _create(comm, ranks):
    """A communicator of ``comm``'s ``ranks``, in that order (collective over them only)."""
    group = comm.Get_group().Incl(list(ranks))
    try:
        return comm.Create_group(group)
    finally:
        group.Free()


def _allgather(comm, row):
    mine = np.asarray(row, dtype=np.int64)
    table = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    comm.Allgather(mine, table)
    return table


def _job_fingerprint():
    """A number naming this process's MPI job (0 where the launcher names none): ranks of
    different jobs cannot share a communicator, whatever their ranks."""
    for variable in JOB_VARIABLES:
        if os.environ.get(variable):
            return zlib.crc32(f"{variable}={os.environ[variable]}".encode())
    return 0


def _launch_hint(why):
    return (f"horovod_sparse exchanges over mpi4py among Horovod's ranks, and cannot map them onto "
            f"MPI processes: {why}. Launch the job through MPI: `horovodrun -np N ...` with Horovod's "
            "MPI controller (not --gloo, nor elastic mode), or `mpirun -np N ...`; hvd.init(comm=...) "
            "with an MPI sub-communicator or a list of COMM_WORLD ranks works too")
