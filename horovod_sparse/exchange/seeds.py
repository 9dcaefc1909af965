"""Seeds of the stochastic codes, derived identically on every rank.

A leaf module (numpy only), so the exchanges and the codes can both import it without
importing each other: :mod:`horovod_sparse.quantize` imports the exchanges, never the
reverse.
"""
import numpy as np


def derive_seed(*parts):
    """One 63-bit seed from a few non-negative ints (base seed, step, rank, chunk, ...).

    Uses numpy's SeedSequence, so nearby inputs give unrelated streams.
    """
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))
