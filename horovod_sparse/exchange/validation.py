"""Local input checks plus the one small collective that makes every rank agree.

Nothing here raises before the collective: local problems become an error code
in this rank's header, the headers are allgathered (one ``Allgather`` of a few
int64), and then EVERY rank raises the same :class:`ExchangeError` naming the
offending ranks - or every rank goes on.  That turns "bad input on one rank"
and "ranks called with different n / algorithm / k / call order" into a clear
error everywhere instead of a hang or silent corruption.

Every exchange (sparse allreduce, compressed allreduce, PowerSGD) agrees the same way:
:func:`agree_call` (identity fields, call counter, tag, local error -> the agreed table,
or ExchangeError on every rank), with :func:`identity_code` for the parameters that
must match. A rank whose gradient overflowed (inf or NaN, ``finite=False``) says so in the
same header: if that is the only problem, every rank raises
:class:`~horovod_sparse.errors.NonFiniteGradientError` instead, and no data moves. So does
an environment switch set to none of its choices (:mod:`horovod_sparse.switches`): that
rank's error, whatever the exchange.
"""
import zlib

import numpy as np

from horovod_sparse import switches
from horovod_sparse.errors import ExchangeError, NonFiniteGradientError

# Header layout: one int64 per field, the same on every rank.
HEADER_FIELDS = ("error_code", "error_detail", "n", "algorithm", "k", "call",
                 "value_dtype", "params", "count", "tag")
_ERROR_TEXT = {
    1: "indices must be a 1-D integer array (numpy or CPU torch tensor)",
    2: "values must be a 1-D float16/float32/float64 array (numpy or CPU torch tensor)",
    3: "indices and values have different lengths (indices length {detail})",
    4: "index {detail} is outside [0, n)",
    5: "index {detail} appears more than once",
    6: "tag must be an integer in [-2**63, 2**63)",
}
# Fields every rank must agree on, with how to print them.
# ``tag`` is the caller's own check value (e.g. a CRC32 of the gradient layout).
_AGREED = ("n", "algorithm", "k", "call", "value_dtype", "params", "tag")
TAG_ERROR_CODE = 6
#: a rank's gradient held an inf or a NaN (its own kind of problem: see agree_call)
NONFINITE_CODE = 100  # apart from every exchange's own codes (1-6 here, 7 compressed, 20 PowerSGD)
#: an environment switch set to none of its choices on this rank (detail: its place in
#: horovod_sparse.switches.CHOICES); checked here, where every exchange's ranks meet
SWITCH_CODE = 30


def tag_as_int64(tag):
    """``tag`` as a Python int if it is an integer (not bool) that fits int64, else None."""
    if isinstance(tag, (bool, np.bool_)) or not isinstance(tag, (int, np.integer)):
        return None
    tag = int(tag)
    return tag if -2 ** 63 <= tag < 2 ** 63 else None


VALUE_DTYPE_CODES = {np.dtype(np.float32): 1, np.dtype(np.float64): 2}


def is_int(value):
    """True for Python and numpy integers, not for bools."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def as_numpy(array):
    """Zero-copy numpy view of a numpy array or torch tensor (no torch import needed)."""
    if isinstance(array, np.ndarray):
        return array
    if hasattr(array, "detach") and hasattr(array, "numpy"):
        return array.detach().cpu().numpy()
    return np.asarray(array)


class LocalInput:
    """This rank's input after local checks: sorted by index, or an error code.

    Attributes: ``indices`` (int64 or the caller's integer dtype, sorted ascending),
    ``values`` (float32 or float64, permuted like ``indices``), ``error_code``,
    ``error_detail`` (ints for the header), ``value_dtype`` (the wire value dtype).
    """

    def __init__(self, indices, values, n):
        self.indices = np.empty(0, np.int64)
        self.values = np.empty(0, np.float32)
        self.error_code = 0
        self.error_detail = 0
        try:
            self._check(indices, values, n)
        except Exception:  # anything odd becomes "bad indices/values", never a local raise
            if self.error_code == 0:
                self.error_code = 1
        self.value_dtype = self.values.dtype

    def _fail(self, code, detail=0):
        self.error_code, self.error_detail = code, int(detail)

    def _check(self, indices, values, n):
        idx = as_numpy(indices)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            return self._fail(1)
        try:
            val = as_numpy(values)
        except Exception:
            return self._fail(2)
        if val.ndim != 1 or val.dtype not in (np.float16, np.float32, np.float64):
            return self._fail(2)
        if val.dtype == np.float16:  # carried as float32 on the wire
            val = val.astype(np.float32)
        self.values = np.ascontiguousarray(val)
        if idx.size != val.size:
            return self._fail(3, idx.size)
        if idx.size == 0:
            self.indices = np.empty(0, np.int64)
            return None
        lowest, highest = idx.min(), idx.max()
        if lowest < 0:
            return self._fail(4, lowest)
        if int(highest) >= n:
            return self._fail(4, highest)
        if idx.dtype != np.int64:
            idx = idx.astype(np.int64)
        # Already strictly increasing (the common case): no copy, no sort.
        if idx.size > 1 and not np.all(idx[1:] > idx[:-1]):
            order = np.argsort(idx, kind="stable")
            idx = idx[order]
            self.values = self.values[order]
            dup = np.flatnonzero(idx[1:] == idx[:-1])
            if dup.size:
                return self._fail(5, idx[dup[0]])
        self.indices = np.ascontiguousarray(idx)
        return None


def identity_code(*fields):
    """One int (a CRC32 of their repr) standing for the parameters every rank must share,
    for the header's ``params`` field."""
    return zlib.crc32(repr(fields).encode())


def agree_call(comm, *, n, call, tag, params, error_code=0, error_detail=0, algorithm=0, k=-1,
               value_dtype=1, count=0, algorithm_names=(), exchange="sparse allreduce",
               error_texts=None, finite=True):
    """Build this rank's agreement header and agree on it: the one helper every exchange
    (sparse allreduce, compressed allreduce, PowerSGD) calls before any data moves. One
    ``Allgather`` of the int64 headers (dicts over HEADER_FIELDS).

    n, algorithm, k, params (:func:`identity_code`), value_dtype : the call's identity,
        which every rank must share (algorithm: an index into ``algorithm_names``).
    call : the exchange's call counter (every rank's must match: same order of calls).
    tag : the caller's check value (an int64; anything else is this rank's error 6).
    error_code, error_detail : this rank's local input error (0: none); the texts of
        the codes are ``_ERROR_TEXT`` updated with ``error_texts`` ({code: text with
        optional {detail}}).
    count : a per-rank number the caller wants from every rank (e.g. its entry count).
    exchange : the name the error message gives the exchange.
    finite : False if this rank's gradient holds an inf or a NaN (a loss scaler's
        overflow; a bad input's error code takes precedence).

    Returns the agreed table as {field: int64 array of P values} (callers reuse the
    per-rank ``count`` without another collective). Raises ExchangeError, the same on
    every rank, naming the offending ranks and fields; NonFiniteGradientError (a subclass)
    when the only problem is that some ranks' gradients are not finite.
    """
    tag_value = tag_as_int64(tag)
    if tag_value is None:  # reported by every rank through the header, never raised alone
        tag_value, error_code = 0, error_code or TAG_ERROR_CODE
    switch = switches.first_invalid()
    if not error_code and switch >= 0:
        error_code, error_detail = SWITCH_CODE, switch
    if not finite and not error_code:
        error_code = NONFINITE_CODE
    header = dict(error_code=error_code, error_detail=error_detail, n=n, algorithm=algorithm, k=k,
                  call=call, value_dtype=value_dtype, params=params, count=count, tag=tag_value)
    texts = {**_ERROR_TEXT, **(error_texts or {})}
    mine = np.array([int(header[f]) for f in HEADER_FIELDS], dtype=np.int64)
    table = np.empty((comm.size, mine.size), dtype=np.int64)
    comm.allgather(mine, table, control=True)
    col = {f: table[:, i] for i, f in enumerate(HEADER_FIELDS)}

    problems = []
    overflowed = np.flatnonzero(col["error_code"] == NONFINITE_CODE)
    for rank in np.flatnonzero((col["error_code"] != 0) & (col["error_code"] != NONFINITE_CODE)):
        code, detail = int(col["error_code"][rank]), int(col["error_detail"][rank])
        text = switches.invalid_text(detail) if code == SWITCH_CODE else \
            texts.get(code, "invalid input").format(detail=detail)
        problems.append(f"rank {rank}: {text} (n = {int(col['n'][rank])})")
    for field in _AGREED:
        values = col[field]
        if np.any(values != values[0]):
            def show(v):
                if field == "algorithm" and 0 <= v < len(algorithm_names):
                    return repr(algorithm_names[v])
                return str(v)
            per_rank = ", ".join(f"rank {r}: {show(int(v))}" for r, v in enumerate(values))
            problems.append(f"ranks disagree on {field} ({per_rank})")
    if problems:
        raise ExchangeError(f"{exchange} call {int(header['call'])} rejected on every rank "
                            "before any data moved: " + "; ".join(problems))
    if overflowed.size:
        raise NonFiniteGradientError(
            f"{exchange} call {int(header['call'])} skipped on every rank: the gradient of rank(s) "
            f"{overflowed.tolist()} holds inf or NaN (a loss scaler's overflow?); nothing was exchanged "
            "and no state changed", ranks=overflowed)
    return col
