"""Cross-rank checks: the ranks compare what they are about to do, and fail together.

A rank that raises alone leaves the others waiting in the next collective, so every
check here is itself collective and ends the same way on every rank: all go on, or all
raise the same error. Built on small buffer-based mpi4py calls (never pickled objects).
The exchange engine's own agreement header (:mod:`horovod_sparse.exchange.validation`)
is the one check that lives elsewhere: it travels with the exchange it guards.

Example::

    comm = communicator_of(None)
    check_same_on_every_rank(algorithm.spec, comm, "compressors or parameters")
    raise_on_every_rank(comm, None if ok else "cannot load the state")
"""
import statistics
import time

import numpy as np

from horovod_sparse.world import process_set_communicator


def communicator_of(process_set=None):
    """A private mpi4py communicator of the ranks of the Horovod ``process_set`` (None: all of
    Horovod's ranks), in the set's rank order; made once per set (collective over the set's
    ranks only). Horovod's ranks, not mpi4py's ``COMM_WORLD``: Horovod may run on a part of
    it (:mod:`horovod_sparse.world`, which raises ``HorovodWorldError`` on every rank where
    Horovod's ranks are not MPI processes of this job).

    Example: ``communicator_of(None).Get_size() == hvd.size()``.
    """
    return process_set_communicator(process_set)


def allgather_int64(comm, values):
    """Every rank's ``values`` (a few ints, the same count on every rank) as an int64 array
    of shape (P, len(values)), row r from rank r. One Allgather.

    Example: ``allgather_int64(comm, [layout.tag, 0])[:, 0]`` are the ranks' tags.
    """
    mine = np.asarray(values, dtype=np.int64).reshape(-1)
    every = np.empty((comm.Get_size(), mine.size), dtype=np.int64)
    comm.Allgather(mine, every)
    return every


def allgather_text(comm, text):
    """Every rank's ``text`` (a str, or None), in rank order: one Allgather of the lengths
    (-1 for None) and, unless every text is empty or None, one Allgatherv of the utf-8 bytes.

    Example: ``allgather_text(comm, str(error))`` on 2 ranks is ``[rank 0's text, rank 1's]``.
    """
    mine = np.frombuffer(b"" if text is None else str(text).encode(), dtype=np.uint8)
    lengths = allgather_int64(comm, [-1 if text is None else mine.size])[:, 0]
    sizes = np.maximum(lengths, 0)
    every = np.empty(int(sizes.sum()), dtype=np.uint8)
    if every.size:  # the same on every rank: nothing to send is the common case
        comm.Allgatherv(mine, (every, sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    return [None if lengths[r] < 0 else every[offsets[r]:offsets[r + 1]].tobytes().decode()
            for r in range(comm.Get_size())]


def max_over_ranks(comm, values):
    """Element-wise maximum of ``values`` (numbers, any shape) over the ranks of the mpi4py
    ``comm``, as a float64 array: a step's time is its slowest rank's.

    Example: ``max_over_ranks(comm, [fwd_s, step_s])``.
    """
    from mpi4py import MPI  # late: importing the library must not start MPI
    a = np.asarray(values, dtype=np.float64)
    out = np.empty_like(a)
    comm.Allreduce(a, out, op=MPI.MAX)
    return out


def time_collective(comm, run, repeats):
    """Median over ``repeats`` (after one warm-up) of the slowest rank's seconds of ``run()``
    (collective: a barrier before each run, one Allreduce(MAX) of the times)."""
    times = []
    for _ in range(repeats + 1):
        comm.Barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(statistics.median(max_over_ranks(comm, times)[1:]))


def raise_on_every_rank(comm, problem, error=ValueError):
    """Raise ``error(text)`` on every rank of ``comm`` if any rank has a ``problem`` (this
    rank's, a str, or None); return None if none has. ``text`` is the same on every rank:
    each distinct problem once, after the ranks that have it.

    Example: rank 1 of 2 passes "cannot load" and rank 0 None: both raise
    ``ValueError("rank 1: cannot load")``.
    """
    ranks_of = {}
    for r, text in enumerate(allgather_text(comm, problem)):
        if text is not None:
            ranks_of.setdefault(text, []).append(r)
    if ranks_of:
        raise error("; ".join(f"{_ranks(ranks)}: {text}" for text, ranks in ranks_of.items()))


def check_same_on_every_rank(text, comm, what):
    """Raise ValueError on every rank of ``comm`` unless every rank passes the same ``text``;
    ``what`` names the texts in the message. Compressors that ride Horovod's own allreduce
    (random-k's shared indices) would otherwise train on with drifting replicas.

    Example: ``check_same_on_every_rank(algorithm.spec, comm, "compressors or parameters")``.
    """
    every = allgather_text(comm, text)
    if any(other != every[0] for other in every):
        listing = "; ".join(f"rank {r}: {other}" for r, other in enumerate(every))
        raise ValueError(f"the ranks passed different {what} ({listing}): "
                         "pass the same on every rank, with the same seed where there is one")


def agree_on_layout(layout, comm, what, refused=False, why="", flag=False):
    """Raise ValueError on every rank of ``comm`` unless all ranks pass the same ``layout``
    (a :class:`~horovod_sparse.layout.GradientLayout`, compared by tag) and none ``refused``
    to go on (then ``why``, the same text on every rank, says why). One Allgather of 24
    bytes: called before anything else collective of a step, so that ranks whose gradients
    differ (a layer frozen on some ranks only) fail together instead of waiting in
    different collectives.

    ``flag`` rides along (a gradient not finite, for ``auto``): returns the ranks that set it.

    Example: ``agree_on_layout(GradientLayout([("fc.weight", (4, 4), "float32")]), comm, "topk")``.
    """
    votes = allgather_int64(comm, [layout.tag, int(bool(refused)), int(bool(flag))])
    refusing = [r for r in range(votes.shape[0]) if votes[r, 1]]
    if refusing:
        raise ValueError(f"{what}: rank(s) {refusing}: {why}")
    differing = [r for r in range(votes.shape[0]) if votes[r, 0] != votes[0, 0]]
    if differing:
        raise ValueError(
            f"the ranks of {what} exchange different gradients: rank(s) {differing} differ from rank 0; "
            f"rank {comm.Get_rank()} has [{layout.describe()}]. Every rank must compress the same "
            "parameters (same shapes and dtypes), and freeze or unfreeze them at the same step")
    return [r for r in range(votes.shape[0]) if votes[r, 2]]


def _ranks(ranks):
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
