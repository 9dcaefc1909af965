"""Ok-Topk (Li & Hoefler, PPoPP'22): split-and-reduce, global threshold, balanced allgatherv.

Per call, with k the target number of globally selected entries:

1. every ``tau`` calls, repartition the index space from the ranks' sorted inputs
   (:func:`.regions.repartition`);
2. split and reduce: region j's entries go to rank j, which sums them
   (:func:`.split_reduce.split_and_reduce`);
3. global selection inside each region by one global magnitude threshold:
   exact (k-th largest |sum|, :func:`.selection.exact_select`) every
   ``tau_prime`` calls, otherwise the previous threshold nudged by
   ``threshold_nudge`` toward k.  If the nudged threshold selects a count
   outside the guaranteed bound below, the exact selection is done instead;
4. balance to equal counts per rank and Allgatherv (:mod:`.balance`).

Guaranteed bound on the number of selected entries, with m the size of the
union of all ranks' input supports and s = ``selection_slack``:

    floor((1 - s) * min(k, m)) <= |selected| <= floor((1 + s) * k)

and exactly ``min(k, m)`` on calls that use the exact threshold.  The values
returned are the full sums (all ranks' contributions) at the selected indices.
"""
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .balance import balanced_allgatherv
from .regions import repartition
from .seeds import derive_seed
from .selection import exact_select
from .sparse_ops import key_to_magnitude, magnitude_keys, threshold_key
from .split_reduce import split_and_reduce

DEFAULTS = dict(tau=64, tau_prime=32, bucket_peers=4, selection_slack=0.2, threshold_nudge=1.012)


@dataclass
class OkTopkState:
    """Everything Ok-Topk carries from call to call.

    step : number of completed calls (drives the tau / tau_prime schedules).
    region_bounds : int64 array of P+1 region bounds, or None before the first call.
    global_threshold : magnitude threshold of the global selection, or None before
        the first exact selection.
    exact_selections : how many calls used the exact threshold (for diagnostics).
    """

    step: int = 0
    region_bounds: Optional[np.ndarray] = None
    global_threshold: Optional[float] = None
    exact_selections: int = 0

    def to_dict(self):
        """numpy/int-only dict (a missing value is stored with a has_* flag of 0)."""
        return {
            "step": int(self.step),
            "has_region_bounds": int(self.region_bounds is not None),
            "region_bounds": (np.empty(0, np.int64) if self.region_bounds is None
                              else np.array(self.region_bounds, dtype=np.int64)),
            "has_global_threshold": int(self.global_threshold is not None),
            "global_threshold": np.float64(0.0 if self.global_threshold is None
                                           else self.global_threshold),
            "exact_selections": int(self.exact_selections),
        }

    @classmethod
    def from_dict(cls, d, size, n):
        bounds = None
        if int(d["has_region_bounds"]):
            bounds = np.array(d["region_bounds"], dtype=np.int64)
            if bounds.shape != (size + 1,) or bounds[0] != 0 or bounds[-1] != n \
                    or np.any(np.diff(bounds) < 0):
                raise ValueError(f"region_bounds must be {size + 1} non-decreasing int64 "
                                 f"values from 0 to n={n}, got {bounds!r}")
        threshold = float(d["global_threshold"]) if int(d["has_global_threshold"]) else None
        return cls(int(d["step"]), bounds, threshold, int(d["exact_selections"]))


def check_params(tau, tau_prime, bucket_peers, selection_slack, threshold_nudge):
    """ValueError naming the parameter and its accepted range."""
    for name, value in (("tau", tau), ("tau_prime", tau_prime), ("bucket_peers", bucket_peers)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not 0.0 < float(selection_slack) < 1.0:
        raise ValueError(f"selection_slack must be in (0, 1), got {selection_slack!r}")
    if not float(threshold_nudge) > 1.0:
        raise ValueError(f"threshold_nudge must be a float > 1, got {threshold_nudge!r}")


class OkTopk:
    """Ok-Topk exchange on a :class:`.comm.CountingComm`.

    Parameters
    ----------
    comm : CountingComm
    n : dense length.
    k : target number of globally selected entries (>= 1).
    index_dtype : wire dtype of indices.
    tau : calls between region repartitions (default 64).
    tau_prime : calls between exact global threshold computations (default 32).
    bucket_peers : rotation steps in flight together in split-and-reduce (default 4).
    selection_slack : relative deviation from k accepted before the exact
        threshold is forced (default 0.2, see the module bound).
    threshold_nudge : factor the threshold is multiplied (count > k) or divided
        (count < k) by between exact computations (default 1.012).
    """

    def __init__(self, comm, n, k, index_dtype, tau, tau_prime, bucket_peers,
                 selection_slack, threshold_nudge):
        check_params(tau, tau_prime, bucket_peers, selection_slack, threshold_nudge)
        self.comm, self.n, self.k, self.index_dtype = comm, n, k, index_dtype
        self.tau, self.tau_prime, self.bucket_peers = int(tau), int(tau_prime), int(bucket_peers)
        self.selection_slack = float(selection_slack)
        self.threshold_nudge = float(threshold_nudge)
        self.state = OkTopkState()
        self.decoded_own = None  # this rank's values as decoded by their owners (codec only)

    #: set by the engine: a ValueCodec for the values on the wire (phase 1 per destination,
    #: phase 2 re-encoded sums), and the call's base seed for stochastic codecs
    codec = None
    seed = 0

    def bounds(self, support):
        """(lower, upper) on the selected count for union support size ``support``."""
        target = min(self.k, support)
        return (math.floor((1 - self.selection_slack) * target),
                math.floor((1 + self.selection_slack) * self.k))

    def run(self, indices, values):
        """One Ok-Topk allreduce; returns (selected indices, summed values, selected)."""
        state, comm = self.state, self.comm
        if state.region_bounds is None or state.step % self.tau == 0:
            state.region_bounds = repartition(comm, indices, self.n)
        encoded = None
        if self.codec is not None:
            values, encoded = self._encode_by_region(indices, values, state.region_bounds)
            self.decoded_own = values
        region_indices, region_values = split_and_reduce(
            comm, indices, values, state.region_bounds, self.index_dtype, self.bucket_peers,
            codec=self.codec, encoded=encoded)

        keys = magnitude_keys(region_values)
        mask, counts = self._select(keys, region_values.dtype)
        state.step += 1
        selected, summed = balanced_allgatherv(comm, region_indices[mask], region_values[mask],
                                               counts, self.index_dtype, codec=self.codec,
                                               seed=self.seed)
        return selected, summed, selected

    def _encode_by_region(self, indices, values, bounds):
        """Encode this rank's values region by region (one code per destination, own
        region included); returns (the values as decoded, float32, the P codes)."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        splits = np.searchsorted(indices, bounds)
        decoded = np.empty_like(values)
        encoded = []
        for j in range(self.comm.size):
            part = slice(splits[j], splits[j + 1])
            codes = self.codec.encode(values[part], derive_seed(self.seed, self.comm.rank, j, 1))
            decoded[part] = self.codec.decode(codes, part.stop - part.start)
            encoded.append(codes)
        return decoded, encoded

    def _select(self, keys, value_dtype):
        """Global threshold selection; returns (local mask, per-rank selected counts)."""
        state, comm = self.state, self.comm
        exact = state.global_threshold is None or state.step % self.tau_prime == 0
        table = np.empty((comm.size, 2), dtype=np.int64)  # per rank: selected, support
        if not exact:
            mask = keys >= threshold_key(state.global_threshold, value_dtype)
            comm.allgather(np.array([mask.sum(), keys.size], dtype=np.int64), table, control=True)
            count, support = int(table[:, 0].sum()), int(table[:, 1].sum())
            lower, upper = self.bounds(support)
            if lower <= count <= upper:
                # Nudge toward k for the next call (identical on all ranks: same count).
                if count > self.k:
                    state.global_threshold *= self.threshold_nudge
                elif count < self.k:
                    state.global_threshold /= self.threshold_nudge
                return mask, table[:, 0].copy()
        else:
            comm.allgather(np.array([0, keys.size], dtype=np.int64), table, control=True)
        support = int(table[:, 1].sum())
        mask, threshold = exact_select(comm, keys, min(self.k, support))
        state.exact_selections += 1
        if support:  # with nothing to select there is no meaningful threshold to keep
            state.global_threshold = key_to_magnitude(threshold, value_dtype)
        counts = np.empty(comm.size, dtype=np.int64)
        comm.allgather(np.array([mask.sum()], dtype=np.int64), counts, control=True)
        return mask, counts
