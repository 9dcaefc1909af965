"""SparseAllreduce: the public entry point that validates, agrees, dispatches and counts,
and the :class:`ExchangeResult` it returns."""
import numpy as np

from horovod_sparse.pipeline import check_identity, with_prefix, without_prefix

from . import allgather, dense, dsa, gtopk, oktopk
from .comm import CountedExchange, CountingComm
from .sparse_ops import wire_index_dtype
from .validation import VALUE_DTYPE_CODES, LocalInput, identity_code, is_int

ALGORITHMS = ("dense", "allgather", "oktopk", "gtopk", "dsa")
_IMPLEMENTATIONS = {
    "dense": (dense.Dense, dense.DEFAULTS),
    "allgather": (allgather.Allgather, allgather.DEFAULTS),
    "oktopk": (oktopk.OkTopk, oktopk.DEFAULTS),
    "gtopk": (gtopk.GTopk, gtopk.DEFAULTS),
    "dsa": (dsa.DSA, dsa.DEFAULTS),
}
_NEEDS_K = ("oktopk", "gtopk")
#: algorithms that can carry values as codes of a ValueCodec
CODEC_ALGORITHMS = ("allgather", "oktopk")
_STATE_FORMAT = 1


class SparseAllreduce(CountedExchange):
    """Sum (or average) sparse vectors over all ranks of an MPI communicator.

    Parameters
    ----------
    n : int >= 0
        Dense length: every index lies in [0, n).  n * P must be < 2**63.
    algorithm : one of ALGORITHMS
        "dense" (Allreduce of the densified vector), "allgather" (TopkA),
        "oktopk" (Ok-Topk), "gtopk" (gTop-k), "dsa" (SparCML-style TopkDSA).
    k : int >= 1, required for "oktopk" and "gtopk"
        Target number of globally selected entries (k >= n is allowed and
        selects the whole support).  Ignored by the other algorithms.
    comm : mpi4py communicator, default MPI.COMM_WORLD
        Duplicated at construction (collective); only the duplicate is used.
    average : bool
        If True the result is the sum divided by P.
    value_codec : None or a :class:`horovod_sparse.quantize.ValueCodec` with
        ``aggregate == "sum"``; "allgather" and "oktopk" only.  Values are then
        carried as float32 codes: encoded before every send and decoded right after
        receipt, before any reduction; the sender uses the decoded version of its
        own values too, so every rank sums the same floats and results stay bitwise
        identical.  Ok-Topk: phase 1 sends one code per destination region, the
        owner sums the decoded values, phase 2 carries the selected sums encoded
        once more (so the result holds a second rounding of the sums).  The byte
        counters count the codes.  ``result.sent_values`` is this rank's values
        as the receivers decoded them.  Part of the agreed parameters: ranks with
        different codecs (by ``repr``) get an ExchangeError.
    **algorithm_params
        oktopk: tau (calls between repartitions, 64), tau_prime (calls between
        exact thresholds, 32), bucket_peers (4), selection_slack (0.2),
        threshold_nudge (1.012); dsa: bucket_peers (4).  See the modules.

    Bad parameters raise ValueError naming the parameter and its accepted range.
    """

    #: every algorithm's name, at its code (in the agreement header and saved states)
    algorithms = ALGORITHMS

    def __init__(self, n, algorithm="oktopk", k=None, comm=None, average=False, value_codec=None,
                 **algorithm_params):
        if not is_int(n) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
        if algorithm in _NEEDS_K and (not is_int(k) or k < 1):
            raise ValueError(f"k must be an integer >= 1 for algorithm {algorithm!r}, got {k!r}")
        if k is not None and (not is_int(k) or k < 1):
            raise ValueError(f"k must be None or an integer >= 1, got {k!r}")
        if not isinstance(average, (bool, np.bool_)):
            raise ValueError(f"average must be True or False, got {average!r}")
        if value_codec is not None:
            if algorithm not in CODEC_ALGORITHMS:
                raise ValueError(f"value_codec is supported for algorithms {CODEC_ALGORITHMS} only, "
                                 f"got algorithm {algorithm!r}")
            if not all(callable(getattr(value_codec, f, None)) for f in ("encode", "decode", "nbytes")) \
                    or getattr(value_codec, "aggregate", "sum") != "sum":
                raise ValueError("value_codec must be None or a ValueCodec (encode/decode/nbytes) "
                                 f"with aggregate 'sum', got {value_codec!r}")
        implementation, defaults = _IMPLEMENTATIONS[algorithm]
        unknown = sorted(set(algorithm_params) - set(defaults))
        if unknown:
            raise ValueError(f"unknown parameter(s) {unknown} for algorithm {algorithm!r}; "
                             f"accepted: {sorted(defaults)}")
        params = dict(defaults, **algorithm_params)
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        if int(n) * comm.Get_size() >= 2 ** 63:
            raise ValueError(f"n must satisfy n * P < 2**63 (int64 region arithmetic), got n={n}")

        self.n, self.algorithm, self.average = int(n), algorithm, bool(average)
        self.k = None if k is None else int(k)
        self.params = params
        self.index_dtype = wire_index_dtype(self.n)
        # Everything that must match across ranks beyond n/algorithm/k, as one int.
        self.value_codec = value_codec
        identity = (self.average, sorted(params.items()))
        if value_codec is not None:  # unchanged code without a codec (same headers as before)
            identity += (getattr(value_codec, "name", ""), repr(value_codec))
        self._params_code = identity_code(*identity)
        self._comm = CountingComm(comm)
        self.size, self.rank = self._comm.size, self._comm.rank
        self._impl = implementation(self._comm, self.n, self.k, self.index_dtype, **params)
        if value_codec is not None:
            self._impl.codec = value_codec

    # ------------------------------------------------------------------ main
    def allreduce(self, indices, values, tag=0, finite=True):
        """Sum the sparse vectors (indices, values) of all ranks; see the class docstring.

        indices : 1-D integer array (numpy or CPU torch tensor), unique, in [0, n).
        values : 1-D float16/float32/float64 array of the same length (float16 is
            carried as float32).
        tag : int in [-2**63, 2**63), default 0.  A caller-chosen check value that
            every rank must pass identically (e.g. a CRC32 of the gradient layout
            being exchanged); it travels in the agreement header, no extra message.
        Raises ExchangeError on every rank if any rank's input is invalid or the
        ranks disagree on n, algorithm, k, parameters, value dtype, call count or tag.
        """
        call = self._next_call()
        before = self._comm.traffic
        local = LocalInput(indices, values, self.n)
        agreed = self._agree(call, n=self.n, tag=tag, params=self._params_code,
                             error_code=local.error_code, error_detail=local.error_detail,
                             algorithm=ALGORITHMS.index(self.algorithm), k=-1 if self.k is None else self.k,
                             value_dtype=VALUE_DTYPE_CODES.get(local.value_dtype, 0),
                             count=local.indices.size, algorithm_names=ALGORITHMS, finite=finite)

        if self.algorithm == "allgather":
            self._impl.counts = agreed["count"]
        values = local.values
        if self.value_codec is not None:
            values = values.astype(np.float32, copy=False)  # codes carry float32
            self._impl.seed = call
        out_indices, out_values, selected = self._impl.run(local.indices, values)
        sent_values = values if self.value_codec is None else self._impl.decoded_own
        if self.average:
            out_values = out_values / out_values.dtype.type(self.size)
        traffic = self._comm.traffic - before
        if self.algorithm == "dense":
            return ExchangeResult(self.n, None, None, None, traffic, dense_values=out_values,
                                  sent_indices=local.indices, sent_values=sent_values)
        return ExchangeResult(self.n, out_indices, out_values, selected, traffic,
                              sent_indices=local.indices, sent_values=sent_values)

    # ----------------------------------------------------------------- state
    def set_k(self, k):
        """Change the target k of "oktopk"/"gtopk" for the following calls (a caller whose
        k follows a schedule, e.g. the FFT compressor's theta).  Every rank must set the
        same k: k travels in the agreement header, so a mismatch raises ExchangeError."""
        if self.algorithm not in _NEEDS_K:
            raise ValueError(f"set_k applies to algorithms {_NEEDS_K}, not {self.algorithm!r}")
        if not is_int(k) or k < 1:
            raise ValueError(f"k must be an integer >= 1, got {k!r}")
        self.k = self._impl.k = int(k)

    def state_dict(self):
        """numpy/int-only dict: identity, call counter and the algorithm's state."""
        d = {**self._identity(), "calls": self._calls}
        if self.algorithm == "oktopk":
            d.update(with_prefix("oktopk_", self._impl.state.to_dict()))
        return d

    def load_state_dict(self, d):
        """Restore what :meth:`state_dict` saved (same algorithm, n and world size)."""
        check_identity(d, self._identity(), "SparseAllreduce")
        if self.algorithm == "oktopk":
            self._impl.state = oktopk.OkTopkState.from_dict(without_prefix(d, "oktopk_"), self.size, self.n)
        self._calls = int(d["calls"])

    def _identity(self):
        return {"format": _STATE_FORMAT, "algorithm": self.algorithm, "n": self.n, "world_size": self.size}


class ExchangeResult:
    """The result of :meth:`SparseAllreduce.allreduce`, identical on every rank.

    indices : sorted unique int64 array, the result's support.
    values : values at ``indices`` (sum over ranks, or average if requested).
    selected : for oktopk/gtopk the globally selected indices (sorted); the
        compressor clears its residual at local ∩ selected
        (:func:`horovod_sparse.exchange.sparse_ops.mask_in_sorted`).  For the
        other algorithms equal to ``indices``.
    traffic : :class:`Traffic` of this call on this rank.
    n : dense length.
    sent_indices : this rank's input indices, sorted (int64).
    sent_values : this rank's input values aligned with ``sent_indices``, as the
        receivers decoded them (with a value codec; else as given, float16 as float32).
    """

    def __init__(self, n, indices, values, selected, traffic, dense_values=None,
                 sent_indices=None, sent_values=None):
        self.n = n
        self.sent_indices, self.sent_values = sent_indices, sent_values
        self._indices, self.values_, self._selected = indices, values, selected
        self._dense = dense_values
        self.traffic = traffic

    @property
    def indices(self):
        if self._indices is None:  # dense algorithm: the support is everything
            self._indices = np.arange(self.n, dtype=np.int64)
        return self._indices

    @property
    def values(self):
        if self.values_ is None:
            self.values_ = self._dense
        return self.values_

    @property
    def selected(self):
        return self.indices if self._selected is None else self._selected

    def dense(self):
        """Dense numpy vector of length n (zeros outside ``indices``)."""
        if self._dense is not None:
            return self._dense.copy()
        out = np.zeros(self.n, dtype=self.values.dtype)
        out[self.indices] = self.values
        return out

    def __repr__(self):
        return (f"ExchangeResult(n={self.n}, nnz={self.indices.size}, "
                f"selected={self.selected.size}, traffic={self.traffic})")
