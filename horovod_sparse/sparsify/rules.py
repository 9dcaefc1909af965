"""The selection rules a :class:`~horovod_sparse.sparsify.Sparsifier` can use, as small objects.

Each rule has ``select(acc, keys, k, step, rank) -> (indices, method)`` where ``acc``
is this rank's accumulated gradient (float32), ``keys`` its magnitude keys, ``k``
the target count, ``step`` the sparsifier's step counter and ``rank`` this rank;
``indices`` are sorted int64 and ``method`` names how they were found (for
diagnostics: ``"exact"``, ``"threshold"``, ``"estimate"``, ``"corrected"``).
Rules with state expose ``state_dict()`` / ``load_state_dict()`` (numpy and ints).
"""
import numpy as np

from horovod_sparse.sparsify import selection


class TopKRule:
    """Exact top-k by magnitude (ties to the lower index): exactly min(k, n) entries."""

    name = "topk"

    def select(self, acc, keys, k, step, rank):
        return selection.top_k(keys, k), "exact"

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass


class ThresholdRule(TopKRule):
    """Fixed threshold: every entry with |acc| >= ``value`` (any count, 0 to n).

    value : magnitude threshold, in the gradient's units (> 0).
    """

    name = "threshold"

    def __init__(self, value):
        self.value = float(value)

    def select(self, acc, keys, k, step, rank):
        return selection.at_least(keys, self.value), "threshold"


class GaussianRule(TopKRule):
    """Gaussiank: threshold |mu| + |Phi^-1(density/2)| * sigma, corrected toward k.

    density : target fraction of entries, in (0, 1].
    The count is guaranteed in [ceil(k/2), 2k] (:func:`selection.settle_threshold`).
    """

    name = "gaussiank"

    def __init__(self, density):
        self.density = float(density)

    def select(self, acc, keys, k, step, rank):
        estimate = selection.gaussian_threshold(acc, self.density)
        indices, _, method = selection.settle_threshold(keys, estimate, k)
        return indices, method


class SampledRule(TopKRule):
    """DGC: the top-density threshold of a random sample, corrected toward k.

    density : target fraction of entries, in (0, 1].
    sample_fraction : fraction of the buffer sampled to estimate the threshold, in (0, 1].
    seed : base of the sample's random stream. The stream of a step is seeded by
        (seed, step, rank), so it is deterministic, differs between ranks and steps,
        and needs no state to be saved.
    The count is guaranteed in [ceil(k/2), 2k] (:func:`selection.settle_threshold`).
    """

    name = "dgc"
    SEED = 0x0D6C  # "DGC"

    def __init__(self, density, sample_fraction, seed=SEED):
        self.density, self.sample_fraction, self.seed = float(density), float(sample_fraction), int(seed)

    def select(self, acc, keys, k, step, rank):
        rng = np.random.default_rng([self.seed, int(step), int(rank)])
        sample_size = max(1, int(np.ceil(self.sample_fraction * keys.size)))
        estimate = selection.sampled_threshold(keys, self.density, sample_size, rng)
        indices, _, method = selection.settle_threshold(keys, estimate, k)
        return indices, method


class OkTopkLocalRule(TopKRule):
    """Ok-Topk's local selection: :class:`selection.LocalThreshold` (exact every tau_prime steps).

    tau_prime : steps between exact recomputations of the local threshold (>= 1).
    nudge : factor (> 1) the threshold moves by per step in between.
    The count is exactly min(k, n) on exact steps and in [ceil(k/2), 2k] otherwise.
    """

    name = "oktopk"

    def __init__(self, tau_prime, nudge=1.012):
        self.local = selection.LocalThreshold(tau_prime, nudge)

    def select(self, acc, keys, k, step, rank):
        return self.local.select(keys, k, step)

    @property
    def threshold(self):
        return self.local.threshold

    def state_dict(self):
        return self.local.state_dict()

    def load_state_dict(self, d):
        self.local.load_state_dict(d)
