"""Local selection rules: which entries of this rank's accumulated gradient it sends.

Every rule works on *magnitude keys* (:func:`horovod_sparse.exchange.sparse_ops.magnitude_keys`):
``|acc|`` read as unsigned integers, ordered like the magnitudes, with NaN above +inf.
So NaN entries always count as the largest and are sent (they then propagate
identically to every rank instead of hiding in a residual), and comparisons are
exact integer comparisons - no float rounding can make two runs differ.

All functions return **sorted, unique int64 indices** and are deterministic:
equal magnitudes are broken by the lower index.

Count guarantee of the estimated-threshold rules (:func:`settle_threshold`, used by
gaussiank, dgc and the Ok-Topk local threshold): for a buffer of ``n >= 1`` elements
and a target ``k`` (``1 <= k <= n``) the number of selected entries always lies in

    COUNT_BOUNDS(k) = [ceil(k / 2), 2 * k]

because an estimate whose count falls outside is corrected by a few bracketing
steps and, if still outside, replaced by the exact top-k (exactly ``k`` entries).
With ``k >= n`` (density 1) every entry is selected.
"""
import math
from statistics import NormalDist

import numpy as np

from horovod_sparse.exchange.sparse_ops import key_to_magnitude, magnitude_keys, threshold_key

#: value dtype of every sparsifier buffer
VALUE_DTYPE = np.dtype(np.float32)
#: how many bracketing corrections an estimated threshold gets before the exact fallback
MAX_CORRECTIONS = 12


def k_for(density, n):
    """Target count for ``n`` elements at ``density`` (a fraction in (0, 1]).

    max(1, ceil(density * n)) for n >= 1 (at most n), 0 for an empty buffer.
    """
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


def count_bounds(k):
    """(lower, upper) inclusive bounds on the count of an estimated-threshold selection."""
    return (k + 1) // 2, 2 * k


def keys_of(acc):
    """Magnitude keys of a float32 array (uint32, NaN largest)."""
    return magnitude_keys(np.ascontiguousarray(acc, dtype=VALUE_DTYPE))


def top_k(keys, k):
    """Exact top-k of the magnitude ``keys``: the ``k`` largest, ties to the lower index.

    O(n): one ``np.partition`` finds the k-th largest key, everything above it is
    taken, and the lowest-indexed entries equal to it fill up to exactly ``k``.
    """
    n = keys.size
    if k <= 0 or n == 0:
        return np.empty(0, np.int64)
    if k >= n:
        return np.arange(n, dtype=np.int64)
    kth = np.partition(keys, n - k)[n - k]  # the k-th largest key
    above = np.flatnonzero(keys > kth)
    ties = np.flatnonzero(keys == kth)[:k - above.size]
    return np.sort(np.concatenate([above, ties])).astype(np.int64, copy=False)


def kth_largest_magnitude(keys, k):
    """The k-th largest magnitude of ``keys`` as a float (0.0 for an empty buffer)."""
    n = keys.size
    if n == 0 or k <= 0:
        return 0.0
    k = min(k, n)
    return key_to_magnitude(np.partition(keys, n - k)[n - k], VALUE_DTYPE)


def at_least(keys, threshold):
    """Indices whose magnitude is >= ``threshold`` (a float magnitude; NaN entries always qualify)."""
    if keys.size == 0:
        return np.empty(0, np.int64)
    return np.flatnonzero(keys >= threshold_key(threshold, VALUE_DTYPE)).astype(np.int64, copy=False)


def _count_at_least(keys, threshold):
    return int(np.count_nonzero(keys >= threshold_key(threshold, VALUE_DTYPE)))


def gaussian_threshold(acc, density):
    """Gaussiank's first estimate: |mu| + |Phi^-1(density / 2)| * sigma of the finite entries of ``acc``.

    If ``acc`` were normal N(mu, sigma) with mu ~ 0, a fraction ``density`` of its
    entries would have a magnitude above this threshold (density/2 in each tail).
    mu and sigma are computed in float64; non-finite entries are ignored (they are
    selected anyway, being the largest keys). Returns +inf if no entry is finite.
    """
    finite = np.isfinite(acc)
    values = acc if finite.all() else acc[finite]  # copy only when something is not finite
    if values.size == 0:
        return math.inf
    z = abs(NormalDist().inv_cdf(density / 2)) if density < 1 else 0.0
    mu = float(np.mean(values, dtype=np.float64))
    return abs(mu) + z * float(np.std(values, dtype=np.float64))


def sampled_threshold(keys, density, sample_size, rng):
    """DGC's first estimate: the top-``density`` magnitude of a random sample of ``keys``.

    ``sample_size`` entries are drawn uniformly (with replacement, O(sample_size))
    from ``rng``; the threshold is the ceil(density * sample_size)-th largest of them.
    """
    n = keys.size
    if n == 0:
        return math.inf
    sample_size = max(1, min(int(sample_size), n))
    sample = keys[rng.integers(0, n, size=sample_size)]
    return kth_largest_magnitude(sample, max(1, math.ceil(density * sample_size)))


def settle_threshold(keys, threshold, k, max_corrections=MAX_CORRECTIONS):
    """Select by an estimated ``threshold``, corrected so the count lands in :func:`count_bounds`.

    Returns ``(indices, threshold_used, method)``; ``method`` is ``"estimate"`` (the
    first estimate was in bounds), ``"corrected"`` (a bracketing correction was) or
    ``"exact"`` (fallback to :func:`top_k`, exactly ``k`` entries, threshold = the
    k-th largest magnitude).

    Correction: a threshold that selects too many is raised, one that selects too
    few is lowered - doubling/halving until the target is bracketed, then geometric
    bisection between the tightest thresholds seen. Each step counts in O(n).
    """
    n = keys.size
    if n == 0 or k <= 0:
        return np.empty(0, np.int64), float(threshold), "estimate"
    if k >= n:  # density 1: everything, whatever the estimate
        return np.arange(n, dtype=np.int64), 0.0, "exact"
    lower, upper = count_bounds(k)
    too_low, too_high = None, None  # thresholds known to select too many / too few
    t = float(threshold)
    for attempt in range(max_corrections + 1):
        if not math.isfinite(t) or t < 0:
            break
        count = _count_at_least(keys, t)
        if lower <= count <= upper:
            return at_least(keys, t), t, "estimate" if attempt == 0 else "corrected"
        if count > upper:
            too_low = t if too_low is None else max(too_low, t)
        else:
            too_high = t if too_high is None else min(too_high, t)
        if too_low is not None and too_high is not None:
            t = math.sqrt(too_low * too_high) if too_low > 0 else too_high / 2
        elif too_high is None:
            if t == 0:  # everything is >= 0: no multiplicative step can leave 0
                break
            t = 2 * t
        else:
            t = t / 2
            if t == 0 or t < np.finfo(np.float32).tiny:
                break
    threshold = kth_largest_magnitude(keys, k)
    return top_k(keys, k), threshold, "exact"


class LocalThreshold:
    """Ok-Topk's local threshold: exact every ``tau_prime`` steps, nudged in between.

    On an exact step the selection is :func:`top_k` and the threshold becomes the
    k-th largest magnitude. On the other steps the selection is ``|acc| >=
    threshold``; then the threshold is multiplied by ``nudge`` if more than ``k``
    entries were selected, divided by it if fewer, so it tracks k slowly without
    a sort. A nudged count outside :func:`count_bounds` (fast drift) triggers the
    exact selection at once, so the count guarantee of this module holds.

    Attributes: ``threshold`` (float magnitude, or None before the first exact
    step), ``exact_steps`` (how many steps used the exact selection).
    """

    def __init__(self, tau_prime, nudge=1.012):
        self.tau_prime, self.nudge = int(tau_prime), float(nudge)
        self.threshold = None
        self.exact_steps = 0

    def select(self, keys, k, step):
        """Indices selected at ``step`` (the sparsifier's step counter); updates the threshold."""
        n = keys.size
        if n == 0 or k <= 0:
            return np.empty(0, np.int64), "exact"
        k = min(k, n)
        if self.threshold is not None and step % self.tau_prime != 0 and k < n:
            indices = at_least(keys, self.threshold)
            lower, upper = count_bounds(k)
            if lower <= indices.size <= upper:
                if indices.size > k:
                    self.threshold *= self.nudge
                elif indices.size < k:
                    self.threshold /= self.nudge
                return indices, "threshold"
        indices = top_k(keys, k)
        threshold = kth_largest_magnitude(keys, k)
        # A zero, infinite or NaN k-th magnitude cannot be nudged: recompute next step.
        self.threshold = threshold if math.isfinite(threshold) and threshold > 0 else None
        self.exact_steps += 1
        return indices, "exact"

    def state_dict(self):
        return {"has_threshold": int(self.threshold is not None),
                "threshold": np.float64(0.0 if self.threshold is None else self.threshold),
                "exact_steps": int(self.exact_steps)}

    def load_state_dict(self, d):
        self.threshold = float(d["threshold"]) if int(d["has_threshold"]) else None
        self.exact_steps = int(d["exact_steps"])
