"""Local selection: which entries of this rank's accumulated gradient it sends.

Every rule works on :class:`MagnitudeKeys`: ``|acc|`` as int32 keys (the float32 bits
with the sign cleared), ordered like the magnitudes, with NaN above +inf. So NaN
entries always count as the largest and are sent (they then reach every rank instead
of hiding in a residual), and comparisons are exact integer comparisons: numpy and
torch, CPU or CUDA, select the same entries bit for bit. Results are **sorted, unique
int64 indices** in the buffer's library and device; equal magnitudes go to the lower
index.

Most steps are one comparison pass and one compaction, because every rule carries a
threshold from step to step:

* :class:`TopKRule` (exact top-k): a *floor* below last step's k-th largest magnitude;
  if between k and ``CANDIDATE_LIMIT * k`` entries reach it, the exact top-k is taken
  among those candidates (O(k)), else by a full O(n) partition (:func:`top_k`);
* :class:`OkTopkLocalRule`: Ok-Topk's local threshold, exact every ``tau_prime`` steps,
  nudged in between (:class:`LocalThreshold`);
* :class:`GaussianRule`: the previous step's settled threshold, scaled by the change of
  the standard deviation of a small strided sample (the Gaussian formula on the first
  step);
* :class:`SampledRule` (DGC): the top-density key of a small strided sample;
* :class:`ThresholdRule`: a fixed threshold.

Count guarantee of the estimated-threshold rules (:func:`settle_threshold`, used by
gaussiank, dgc and Ok-Topk's local threshold): for a buffer of ``n >= 1`` elements and
a target ``k`` (``1 <= k <= n``) the number of selected entries always lies in

    count_bounds(k) = [ceil(k / 2), 2 * k]

because an estimate whose count falls outside is corrected by a few bracketing steps
and, if still outside, replaced by the exact top-k (exactly ``k`` entries). With
``k >= n`` (density 1) every entry is selected.

Each rule has ``select(acc, keys, k, step, rank) -> (indices, method)``; ``method``
names how the indices were found (``"exact"``, ``"threshold"``, ``"estimate"``,
``"corrected"``), and ``state_dict()`` / ``load_state_dict()`` hold the carried
thresholds (Python ints and numpy scalars).
"""
import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from horovod_sparse.ops import cpu
from horovod_sparse.ops.cpu import sparsify as fused
from horovod_sparse.ops.host import to_host, to_list
from horovod_sparse.ops.indices import compact, count_nonzero, take
from horovod_sparse.ops.kernels import copy, mark_at_least, set_true_at
from horovod_sparse.ops.magnitude import key_of, kth_largest, kth_largests, magnitude_keys, magnitude_of, smallest
from horovod_sparse.ops.namespace import (arange, dtype_of, empty, host_shortcut_allowed, is_tensorflow, is_torch,
                                         namespace, zeros)
from horovod_sparse.ops.views import as_like, numpy_view
from horovod_sparse.sparsify.device_topk import NO_FLOOR, SOURCES, device_top_k

#: value dtype of every sparsifier buffer
VALUE_DTYPE = np.dtype(np.float32)
#: how many bracketing corrections an estimated threshold gets before the exact fallback
MAX_CORRECTIONS = 12
#: exact top-k from the floor's candidates when their count lies in [k, CANDIDATE_LIMIT * k]
CANDIDATE_LIMIT = 4
#: a floor whose count lies in this range (times k) is kept for the next step; else the next
#: floor is set where this step had CANDIDATE_TARGET * k candidates
CANDIDATE_COMFORT = (1.2, 2.0)
CANDIDATE_TARGET = 1.5
#: a floor set from a k-th magnitude alone lies this factor below it
FLOOR_MARGIN = 1.05
#: at most this many entries of the buffer estimate Gaussiank's standard deviation
GAUSSIAN_SAMPLE = 4096
#: at most this many keys (every ceil(n / size)-th) estimate a floor when the carried one fails
FLOOR_SAMPLE = 65536
#: the estimated-threshold rules collect candidates this factor below their last threshold
#: (the next estimate moves with the gradient's spread; a few percent per step)
ESTIMATE_MARGIN = 1.15
_INF_KEY = 0x7F800000


def k_for(density, n):
    """Target count for ``n`` elements at ``density`` (a fraction in (0, 1]).

    max(1, ceil(density * n)) for n >= 1 (at most n), 0 for an empty buffer.
    """
    return 0 if n == 0 else min(n, max(1, math.ceil(density * n)))


def count_bounds(k):
    """(lower, upper) inclusive bounds on the count of an estimated-threshold selection."""
    return (k + 1) // 2, 2 * k


class MagnitudeKeys:
    """The keys of one accumulated buffer and a bool scratch mask: what every rule reads.

    acc : float32 1-D buffer (numpy or torch). ``keys`` (int32) and ``mask`` (bool)
        are scratch buffers of the same length, library and device, reused from step
        to step (allocated here if None).
    candidates : None, or the :class:`~horovod_sparse.sparsify.first_pass.Candidates` the
        step's first pass collected: every entry whose key reaches their floor. Questions
        about keys at or above that floor are answered from them; one below it (or beyond
        what they hold) is answered by ``rescan(key)`` (new candidates, one read pass) where
        given, else by the keys of the whole buffer, computed then (the same answers).

    :meth:`count_at_least` marks the entries at or above a key (one comparison pass)
    and :meth:`at_least` compacts the marked entries into indices, so "count, check
    the bounds, then take" costs a single comparison.
    """

    def __init__(self, acc, keys=None, mask=None, candidates=None, rescan=None):
        self.acc, self.size = acc, int(acc.shape[0])
        self._rescan = rescan  # rescan(key) -> the candidates at another floor (one read pass), or None
        scratch = not is_tensorflow(acc)  # TensorFlow makes new tensors: no scratch to reuse
        self._keys_out = keys if keys is not None or not scratch else empty(self.size, "int32", acc)
        self._keys = None
        self.mask = empty(self.size, "bool", acc) if mask is None and scratch else mask
        self._marked, self._marked_count = None, None  # the key the mask holds ``keys >= key`` for, its count
        self.candidates = candidates
        self._answered = None  # (indices, their keys) of the last at_least answered from the candidates
        if candidates is None:
            self._keys = magnitude_keys(acc, out=self._keys_out)

    @property
    def keys(self):
        """The int32 keys of the whole buffer (computed at the first use: one pass)."""
        if self._keys is None:
            self._keys = magnitude_keys(self.acc, out=self._keys_out)
        return self._keys

    def _covers(self, key):
        """Whether the candidates hold every entry whose key is >= ``key``."""
        c = self.candidates
        return c is not None and c.complete and key >= c.floor

    def count_at_least(self, key):
        c = self.candidates
        if c is not None and key == c.floor:  # counted in the first pass, written or not
            return c.count
        if self._covers(key):
            return count_nonzero(c.keys >= key)
        if self._rescan is not None and self._keys is None:
            self.candidates, self._answered = self._rescan(key), None  # (the scratch they viewed is rewritten)
            return self.candidates.count
        self._marked = key
        self.mask, self._marked_count = mark_at_least(self.keys, key, self.mask)
        return self._marked_count

    def at_least(self, key, keep=True):
        """Sorted int64 indices whose key is >= ``key`` (``keep=False``: a caller that keeps none
        of them past this step may get a view of the candidates' scratch buffer)."""
        if not self._covers(key) and self._rescan is not None and self._keys is None:
            c = self.candidates
            self.candidates, self._answered = self._rescan(key, c.count if key == c.floor else 0), None
            if not self.candidates.complete:  # more than the buffers held: now they hold them all
                self.candidates = self._rescan(key, self.candidates.count)
        if self._covers(key):
            c = self.candidates
            if key == c.floor:  # all of them: copied out of the scratch, unless the caller will not keep them
                self._answered = (copy(c.indices) if keep else c.indices, c.keys)
            else:
                taken = compact(c.keys >= key)
                self._answered = (take(c.indices, taken), take(c.keys, taken))
            return self._answered[0]
        if self._marked != key:
            self._marked = key
            self.mask, self._marked_count = mark_at_least(self.keys, key, self.mask)
        return compact(self.mask, self._marked_count)  # (a known count: no second read-back on a device)

    def at(self, indices):
        if self._answered is not None and indices is self._answered[0]:
            return self._answered[1]
        if self._keys is None:  # a gather of the values, not a pass over the buffer
            return magnitude_keys(take(self.acc, indices))
        return take(self._keys, indices)

    def strided(self, start, stride, size=None):
        """The keys of every ``stride``-th entry from ``start`` (at most ``size`` of them)."""
        if self._keys is not None:
            return self._keys[start::stride][:size]
        sample = self.acc[start::stride][:size]
        return magnitude_keys(sample.contiguous() if is_torch(sample) else np.ascontiguousarray(sample))

    def kth_largest(self, k):
        return kth_largest(self.keys, k)

    def on_device(self):
        """Whether the keys are torch's on the device path (no first pass's candidates, no numpy view)."""
        return is_torch(self.acc) and self.candidates is None and numpy_view(self.acc) is None

    def empty_indices(self):
        return empty(0, "int64", self.acc)

    def all_indices(self):
        return arange(self.size, self.acc)


def keys_of(acc):
    """:class:`MagnitudeKeys` of a float32 buffer, with fresh scratch buffers."""
    if not is_torch(acc):
        acc = np.ascontiguousarray(acc, dtype=VALUE_DTYPE)
    return MagnitudeKeys(acc)


# ---------------------------------------------------------------------------- exact top-k
@dataclass
class TopK:
    """An exact top-k: ``indices``; ``kth`` the k-th largest key; ``floor`` the key to try
    as the next step's floor (None if none is sensible); ``source`` where the candidates
    came from: ``"floor"`` (the given one), ``"sample"`` (a sampled floor), ``"full"``
    (a partition of the whole buffer) or ``"all"`` (k <= 0 or k >= n)."""

    indices: object
    kth: int
    floor: object
    source: str


def top_k(keys, k, floor=None):
    """Exact top-k of ``keys`` (a :class:`MagnitudeKeys`): the ``k`` largest, ties to the lower index.

    1. With a ``floor`` key, count the keys >= floor; if between k and
       ``CANDIDATE_LIMIT * k``, those are the candidates (one comparison pass).
    2. Otherwise the same with a floor estimated from a strided sample of the keys (its
       ``CANDIDATE_TARGET * k / n`` quantile); if that count is out of range too, find
       the k-th largest key by a full partition and take the keys >= it.
    3. Among the candidates: everything above their k-th largest key, plus the
       lowest-indexed ties, exactly ``min(k, n)`` entries.
    4. Next floor: the same if its count was comfortable (``CANDIDATE_COMFORT``), else
       the ``ceil(CANDIDATE_TARGET * k)``-th largest candidate key if there are that
       many, else ``FLOOR_MARGIN`` below the lowest candidate.
    """
    n = keys.size
    if k <= 0 or n == 0:
        return TopK(keys.empty_indices(), _INF_KEY, floor, "all")
    if k >= n:
        return TopK(keys.all_indices(), smallest(keys.keys), floor, "all")
    if keys.on_device():  # the same answers as device tensors, none read back
        return TopK(*device_top_k(keys, k, floor, (CANDIDATE_LIMIT, CANDIDATE_COMFORT, CANDIDATE_TARGET,
                                                   FLOOR_MARGIN, FLOOR_SAMPLE)))
    source = "floor"
    candidates = None if floor is None else _candidates(keys, floor, k)        # step 1
    if candidates is None:                                                      # step 2
        source, candidates = "sample", _candidates(keys, _sampled_floor(keys, k), k)
    if candidates is None:
        source, candidates = "full", keys.at_least(keys.kth_largest(k))
    candidate_keys = keys.at(candidates)
    target, count = math.ceil(CANDIDATE_TARGET * k), int(candidate_keys.shape[0])
    low, high = CANDIDATE_COMFORT
    keep_floor = source == "floor" and low * k <= count <= high * k
    if keep_floor or count < target:                                            # step 3
        kth = kth_largest(candidate_keys, k)
    else:  # one partition finds the k-th key and the next floor's
        kth, target_key = kth_largests(candidate_keys, [k, target])
    indices = _top_of_candidates(candidates, candidate_keys, kth, k)
    if keep_floor:                                                              # step 4
        next_floor = floor
    elif count >= target:
        next_floor = target_key
    else:
        next_floor = _lowered(smallest(candidate_keys))
    return TopK(indices, kth, next_floor, source)


def _candidates(keys, floor, k):
    """The indices of the keys >= ``floor`` if there are k to CANDIDATE_LIMIT * k of them, else None
    (possibly a view of scratch buffers: :func:`top_k` keeps only what it takes from them)."""
    if k <= keys.count_at_least(floor) <= CANDIDATE_LIMIT * k:
        return keys.at_least(floor, keep=False)
    return None


def _top_of_candidates(candidates, candidate_keys, kth, k):
    """Step 3 of :func:`top_k`: the candidates above ``kth`` and the lowest-indexed ties at it,
    ``k`` in all (one compiled pass on the CPU, :func:`~horovod_sparse.ops.cpu.sparsify.take_top`)."""
    index_view, key_view = numpy_view(candidates), numpy_view(candidate_keys)
    if cpu.enabled() and index_view is not None and key_view is not None:
        out = np.empty(k, np.int64)
        written = fused.take_top(index_view, key_view, np.int32(kth), k, out)
        return as_like(out[:written], candidates)
    taken = candidate_keys > kth
    missing = k - count_nonzero(taken)
    if missing > 0:
        taken = set_true_at(taken, compact(candidate_keys == kth)[:missing])
    return take(candidates, compact(taken))


def _sampled_floor(keys, k):
    """The key with about ``CANDIDATE_TARGET * k`` keys above it, by the matching quantile of
    every ``ceil(n / FLOOR_SAMPLE)``-th key."""
    stride = -(-keys.size // FLOOR_SAMPLE)
    sample = keys.strided(0, stride)
    size = int(sample.shape[0])
    return kth_largest(sample, min(size, math.ceil(CANDIDATE_TARGET * k * size / keys.size)))


def _lowered(key):
    """The key FLOOR_MARGIN below ``key``'s magnitude; None for NaN keys."""
    magnitude = magnitude_of(key)
    return None if math.isnan(magnitude) else key_of(magnitude / FLOOR_MARGIN)


# ---------------------------------------------------------------------- estimated thresholds
def settle_threshold(keys, threshold, k, max_corrections=MAX_CORRECTIONS):
    """Select by an estimated ``threshold``, corrected so the count lands in :func:`count_bounds`.

    Returns ``(indices, threshold_used, method)``; ``method`` is ``"estimate"`` (the
    first estimate was in bounds), ``"corrected"`` (a bracketing correction was) or
    ``"exact"`` (fallback to :func:`top_k`, exactly ``k`` entries, threshold = the
    k-th largest magnitude).

    Correction: a threshold that selects too many is raised, one that selects too few
    is lowered - doubling/halving until the target is bracketed, then geometric
    bisection between the tightest thresholds seen. Each step is one comparison pass.
    """
    n = keys.size
    if n == 0 or k <= 0:
        return keys.empty_indices(), float(threshold), "estimate"
    if k >= n:  # density 1: everything, whatever the estimate
        return keys.all_indices(), 0.0, "exact"
    lower, upper = count_bounds(k)
    too_low, too_high = None, None  # thresholds known to select too many / too few
    t = float(threshold)
    for attempt in range(max_corrections + 1):
        if not math.isfinite(t) or t < 0:
            break
        key = key_of(t)
        count = keys.count_at_least(key)
        if lower <= count <= upper:
            return keys.at_least(key), t, "estimate" if attempt == 0 else "corrected"
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
    exact = top_k(keys, k)
    return exact.indices, magnitude_of(exact.kth), "exact"


def gaussian_threshold(mu, sigma, density):
    """Gaussiank's estimate |mu| + |Phi^-1(density / 2)| * sigma (+inf if sigma is not finite).

    If ``acc`` were normal N(mu, sigma) with mu ~ 0, a fraction ``density`` of its
    entries would have a magnitude above this threshold (density/2 in each tail).
    """
    if not (math.isfinite(mu) and math.isfinite(sigma)):
        return math.inf
    z = abs(NormalDist().inv_cdf(density / 2)) if density < 1 else 0.0
    return abs(mu) + z * sigma


def sample_moments(acc, size=GAUSSIAN_SAMPLE):
    """(mean, standard deviation) in float64 of the finite entries of a strided sample of
    at most ``size`` entries of ``acc`` (every ``ceil(n / size)``-th, from 0), as Python floats;
    NaNs if none is finite. Computed where ``acc`` lives (a torch tensor on the device path or a
    GPU: one read-back of the two numbers, not the sample) by :func:`_tree_sums`, whose fixed
    order of additions gives numpy's and torch's the same bits on any device."""
    n = int(acc.shape[0])
    stride = max(1, -(-n // size))
    sample = acc[::stride]
    if is_torch(sample) and not host_shortcut_allowed(sample):
        mean, variance = to_list(mean_and_variance(sample.to(dtype_of(sample, "float64"))))
    else:
        mean, variance = (float(v) for v in mean_and_variance(to_host(sample).astype(np.float64)))
    return mean, math.sqrt(variance) if variance >= 0 else math.nan  # correctly rounded: torch's is not


def mean_and_variance(sample):
    """The mean and variance of a float64 sample's finite entries, as a 2-element float64 array
    of its library and device, NaNs if none is finite: the sums (the count of finite entries too,
    exact in float64) by :func:`_tree_sums`, the deviations squared as ``d * d``."""
    xp = namespace(sample)
    finite = xp.isfinite(sample)
    zero = xp.zeros_like(sample)
    values = xp.where(finite, sample, zero)
    count, total = _tree_sums(xp, [xp.astype(finite, sample.dtype), values])
    with np.errstate(invalid="ignore", divide="ignore"):  # none finite: 0 / 0
        mean = total / count
        deviation = xp.where(finite, values - mean, zero)
        (squares,) = _tree_sums(xp, [deviation * deviation])
        return xp.stack([mean, squares / count])


def _tree_sums(xp, rows):
    """The sums of 1-D float64 ``rows`` of one length, zero-padded to a power of two (zeros add
    nothing, exactly): their halves added element-wise until one value is left, all rows at once
    (one rounded add per pair, in an order fixed by the length, which no library's reduction
    promises: numpy's is pairwise by blocks of 8, torch's vectorised on the CPU and a tree of
    threads on a GPU)."""
    m = int(rows[0].shape[0])
    v = zeros(len(rows) << max(m - 1, 0).bit_length(), "float64", rows[0])
    v = xp.reshape(v, (len(rows), -1))
    for i, row in enumerate(rows):
        v[i, :m] = row
    while v.shape[1] > 1:
        half = v.shape[1] // 2
        v = v[:, :half] + v[:, half:]
    return [v[i, 0] for i in range(len(rows))]


# ----------------------------------------------------------------------------------- rules
class Rule:
    """A selection rule without state."""

    name = "abstract"

    def select(self, acc, keys, k, step, rank):
        raise NotImplementedError

    def candidate_floor(self):
        """A key at or below the first key this rule will ask about at its next step, or None:
        the step's first pass collects the entries that reach it (:mod:`.first_pass`). A hint
        for speed only: the selection is the same whatever it is."""
        return None

    def state_dict(self):
        return {}

    def load_state_dict(self, d):
        pass

    def snapshot(self):
        """What :meth:`restore` needs to undo a step (a step that failed keeps no threshold)."""
        return self.state_dict()

    def restore(self, snapshot):
        self.load_state_dict(snapshot)


class TopKRule(Rule):
    """Exact top-k by magnitude (ties to the lower index): exactly min(k, n) entries.

    Carries a floor key from step to step (see :func:`top_k`); ``sampled_floors`` and
    ``full_selections`` count the steps whose carried floor failed and that found their
    candidates by a sampled floor, or needed a full partition.
    """

    name = "topk"

    def __init__(self):
        self.floor, self.sampled_floors, self.full_selections = None, 0, 0

    def candidate_floor(self):
        return self._host_floor()

    def select(self, acc, keys, k, step, rank):
        # (a device's floor read back only if this step runs on the host: the path was switched)
        found = top_k(keys, k, self.floor if keys.on_device() else self._host_floor())
        self.floor = found.floor
        if isinstance(found.source, str):
            self.sampled_floors += int(found.source == "sample")
            self.full_selections += int(found.source == "full")
        else:  # the device's codes: the counts stay there too, read at a checkpoint
            self.sampled_floors = (found.source == SOURCES.index("sample")) + self.sampled_floors
            self.full_selections = (found.source == SOURCES.index("full")) + self.full_selections
        return found.indices, "exact"

    def snapshot(self):  # as they are: a device's are not read back (select replaces, never updates, them)
        return self.floor, self.sampled_floors, self.full_selections

    def restore(self, snapshot):
        self.floor, self.sampled_floors, self.full_selections = snapshot

    def _host_floor(self):
        """The floor as the host's: a Python int or None (a device's is read back)."""
        if self.floor is None or isinstance(self.floor, int):
            return self.floor
        floor = int(self.floor)
        return None if floor == NO_FLOOR else floor

    def state_dict(self):
        floor = self._host_floor()
        return {"has_floor": int(floor is not None), "floor": int(0 if floor is None else floor),
                "sampled_floors": int(self.sampled_floors), "full_selections": int(self.full_selections)}

    def load_state_dict(self, d):
        # Checkpoints written before the floor existed have no rule state: start without one.
        self.floor = int(d["floor"]) if int(d.get("has_floor", 0)) else None
        self.sampled_floors = int(d.get("sampled_floors", 0))
        self.full_selections = int(d.get("full_selections", 0))


class ThresholdRule(Rule):
    """Fixed threshold: every entry with |acc| >= ``value`` (any count, 0 to n).

    value : magnitude threshold, in the gradient's units (> 0).
    """

    name = "threshold"

    def __init__(self, value):
        self.value = float(value)

    def candidate_floor(self):
        return key_of(self.value)

    def select(self, acc, keys, k, step, rank):
        return keys.at_least(key_of(self.value)), "threshold"


class GaussianRule(Rule):
    """Gaussiank: a threshold from the Gaussian model of acc, corrected toward k.

    1. mu, sigma of a strided sample of acc (:func:`sample_moments`);
    2. first guess: the previous step's settled threshold times sigma / previous sigma,
       or on the first step (or after a degenerate one) the Gaussian estimate
       |mu| + |Phi^-1(density/2)| * sigma (:func:`gaussian_threshold`);
    3. :func:`settle_threshold`: the count is guaranteed in [ceil(k/2), 2k].

    density : target fraction of entries, in (0, 1].
    """

    name = "gaussiank"

    def __init__(self, density):
        self.density = float(density)
        self.threshold, self.sigma = None, None

    def candidate_floor(self):
        return None if self.threshold is None else key_of(self.threshold / ESTIMATE_MARGIN)

    def select(self, acc, keys, k, step, rank):
        if keys.size == 0 or k <= 0:
            return keys.empty_indices(), "estimate"
        mu, sigma = sample_moments(acc)                                         # step 1
        if self.threshold is not None and self.sigma > 0 and sigma > 0:         # step 2
            estimate = self.threshold * (sigma / self.sigma)
        else:
            estimate = gaussian_threshold(mu, sigma, self.density)
        indices, used, method = settle_threshold(keys, estimate, k)             # step 3
        settled = math.isfinite(used) and used > 0 and math.isfinite(sigma) and sigma > 0
        self.threshold, self.sigma = (used, sigma) if settled else (None, None)
        return indices, method

    def state_dict(self):
        return {"has_threshold": int(self.threshold is not None),
                "threshold": np.float64(0.0 if self.threshold is None else self.threshold),
                "sigma": np.float64(0.0 if self.sigma is None else self.sigma)}

    def load_state_dict(self, d):
        carried = int(d.get("has_threshold", 0))
        self.threshold = float(d["threshold"]) if carried else None
        self.sigma = float(d["sigma"]) if carried else None


class SampledRule(Rule):
    """DGC: the top-density threshold of a sample of acc, corrected toward k.

    The sample is systematic: ``ceil(sample_fraction * n)`` keys at a fixed stride from a
    random start. The start is drawn from a stream seeded by (seed, step, rank), so it is
    deterministic, differs between ranks and steps, and needs no state to be saved; a
    strided view needs no index array (nothing crosses to the host).

    density : target fraction of entries, in (0, 1].
    sample_fraction : fraction of the buffer sampled to estimate the threshold, in (0, 1].
    The count is guaranteed in [ceil(k/2), 2k] (:func:`settle_threshold`).
    """

    name = "dgc"
    SEED = 0x0D6C  # "DGC"

    def __init__(self, density, sample_fraction, seed=SEED):
        self.density, self.sample_fraction, self.seed = float(density), float(sample_fraction), int(seed)
        # the last settled threshold: only where the next step's candidates start (a hint for
        # speed, not state: the selection never reads it, so checkpoints leave it out)
        self._settled = None

    def sample(self, keys, step, rank):
        """The sampled keys (of a strided view of acc)."""
        n = keys.size
        size = max(1, min(n, math.ceil(self.sample_fraction * n)))
        stride = n // size
        start = int(np.random.default_rng([self.seed, int(step), int(rank)]).integers(0, stride))
        return keys.strided(start, stride, size)

    def candidate_floor(self):
        return None if self._settled is None else key_of(self._settled / ESTIMATE_MARGIN)

    def select(self, acc, keys, k, step, rank):
        if keys.size == 0 or k <= 0:
            return keys.empty_indices(), "estimate"
        sample = self.sample(keys, step, rank)
        size = int(sample.shape[0])
        estimate = magnitude_of(kth_largest(sample, max(1, math.ceil(self.density * size))))
        indices, used, method = settle_threshold(keys, estimate, k)
        self._settled = used if math.isfinite(used) and used > 0 else None
        return indices, method


class LocalThreshold:
    """Ok-Topk's local threshold: exact every ``tau_prime`` steps, nudged in between.

    On an exact step the selection is :func:`top_k` (its floor FLOOR_MARGIN below the
    current threshold, so usually O(k)) and the threshold becomes the k-th largest
    magnitude. On the other steps the selection is ``|acc| >= threshold``; then the
    threshold is multiplied by ``nudge`` if more than ``k`` entries were selected,
    divided by it if fewer, so it tracks k slowly without a sort. A nudged count
    outside :func:`count_bounds` (fast drift) triggers the exact selection at once,
    so the count guarantee of this module holds.

    Attributes: ``threshold`` (float magnitude, or None before the first exact step),
    ``exact_steps`` (how many steps used the exact selection).
    """

    def __init__(self, tau_prime, nudge=1.012):
        self.tau_prime, self.nudge = int(tau_prime), float(nudge)
        self.threshold = None
        self.exact_steps = 0

    def select(self, keys, k, step):
        """Indices selected at ``step`` (the sparsifier's step counter); updates the threshold."""
        n = keys.size
        if n == 0 or k <= 0:
            return keys.empty_indices(), "exact"
        k = min(k, n)
        if self.threshold is not None and step % self.tau_prime != 0 and k < n:
            key = key_of(self.threshold)
            count = keys.count_at_least(key)
            lower, upper = count_bounds(k)
            if lower <= count <= upper:
                if count > k:
                    self.threshold *= self.nudge
                elif count < k:
                    self.threshold /= self.nudge
                return keys.at_least(key), "threshold"
        floor = None if self.threshold is None else key_of(self.threshold / FLOOR_MARGIN)
        found = top_k(keys, k, floor)
        threshold = magnitude_of(found.kth)
        # A zero, infinite or NaN k-th magnitude cannot be nudged: recompute next step.
        self.threshold = threshold if math.isfinite(threshold) and threshold > 0 else None
        self.exact_steps += 1
        return found.indices, "exact"

    def state_dict(self):
        return {"has_threshold": int(self.threshold is not None),
                "threshold": np.float64(0.0 if self.threshold is None else self.threshold),
                "exact_steps": int(self.exact_steps)}

    def load_state_dict(self, d):
        self.threshold = float(d["threshold"]) if int(d["has_threshold"]) else None
        self.exact_steps = int(d["exact_steps"])


class OkTopkLocalRule(Rule):
    """Ok-Topk's local selection: :class:`LocalThreshold` (exact every tau_prime steps).

    tau_prime : steps between exact recomputations of the local threshold (>= 1).
    nudge : factor (> 1) the threshold moves by per step in between.
    The count is exactly min(k, n) on exact steps and in [ceil(k/2), 2k] otherwise.
    """

    name = "oktopk"

    def __init__(self, tau_prime, nudge=1.012):
        self.local = LocalThreshold(tau_prime, nudge)

    def candidate_floor(self):
        # the exact steps' floor (below the threshold the other steps ask about)
        t = self.local.threshold
        return None if t is None else key_of(t / FLOOR_MARGIN)

    def select(self, acc, keys, k, step, rank):
        return self.local.select(keys, k, step)

    @property
    def threshold(self):
        return self.local.threshold

    def state_dict(self):
        return self.local.state_dict()

    def load_state_dict(self, d):
        self.local.load_state_dict(d)
