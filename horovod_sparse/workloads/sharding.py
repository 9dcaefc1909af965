"""Each rank's shard of one global stream of training examples, the same on every run.

The stream is a concatenation of seeded permutations of the data set, one per epoch (epoch
``e`` is ``numpy.random.default_rng([seed, e]).permutation(n)``). Global step ``k`` takes the
stream's next ``batch * size`` examples and rank ``r`` its ``r``-th slice of ``batch`` of them,
so the ranks' shards are disjoint and together make the global batch. The stream depends on
``n`` and ``seed`` only: P ranks at batch b see, step for step, the examples that one process
at batch P * b sees. A global batch may run across an epoch's end (and then may hold an
example twice, once from each epoch).

    >>> shards = [shard_indices(10, rank, size=2, batch=3) for rank in (0, 1)]
    >>> [next(s).tolist() for s in shards]  # the first global batch: the stream's first 6
    [[4, 6, 2], [7, 3, 5]]
    >>> next(shard_indices(10, rank=0, size=1, batch=6)).tolist()
    [4, 6, 2, 7, 3, 5]
"""
import itertools

import numpy as np


def example_stream(n, seed=0):
    """The epochs' permutations of ``range(n)``, one array per epoch, without end."""
    for epoch in itertools.count():
        yield np.random.default_rng([seed, epoch]).permutation(n)


def shard_indices(n, rank, size, batch, seed=0):
    """Rank ``rank``'s example indices for each global step, without end (int64 arrays of ``batch``)."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    if batch < 1 or n < 1:
        raise ValueError(f"need batch >= 1 and n >= 1, got batch={batch}, n={n}")
    width = batch * size
    epochs = example_stream(n, seed)
    pending = np.empty(0, dtype=np.int64)
    while True:
        while len(pending) < width:
            pending = np.concatenate([pending, next(epochs)])
        step, pending = pending[:width], pending[width:]
        yield step[rank * batch:(rank + 1) * batch]
