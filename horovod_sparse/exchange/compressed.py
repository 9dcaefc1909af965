"""Allreduce of dense float32 vectors carried as codes (quantizers): alltoall or allgather.

Two exchanges, both over :class:`~.comm.CountingComm` (every byte counted):

* ``"alltoall"`` (DeepSpeed 1-bit Adam's compressed allreduce; volume per rank about
  2 (P-1)/P * nbytes(n), independent of P): the vector is cut into P chunks,
  chunk j = [j*n//P, (j+1)*n//P) belonging to rank j. Every rank encodes each chunk j
  with seed ``derive_seed(seed, rank, j)`` and sends it to its owner (one Alltoallv;
  sizes come from ``codec.nbytes``, so no size exchange). The owner decodes the P
  pieces of its chunk, sums them in rank order in float32 (starting from zeros),
  optionally adds its server residual, re-encodes the sum with seed
  ``derive_seed(seed, P + rank, rank)`` and (with server error feedback) keeps
  ``sum + residual - decode(code)`` as the new residual. One Allgatherv of the
  encoded chunks, and every rank decodes every chunk: the same bytes decoded by the
  same pure function, so the result is bitwise identical on every rank.

  Payload bytes sent per rank, exactly:
  ``sum_{j != rank} nbytes(|chunk j|) + (P - 1) * nbytes(|chunk rank|)``.

* ``"allgather"`` (GRACE's allgather communicator; volume (P-1) * nbytes(n), grows
  with P): every rank encodes its whole vector with seed ``derive_seed(seed, rank)``,
  one Allgatherv, and every rank decodes all P codes and sums them in rank order in
  float32 (starting from zeros). Payload bytes sent per rank, exactly:
  ``(P - 1) * nbytes(n)``.

Codecs with ``aggregate == "majority"`` (signSGD's vote): the result is
``P * sign(sum of the decoded contributions)`` with sign(0) = +1, with either method
(alltoall: the owner encodes its chunk's vote, +-1, with the same codec).

Before any data moves, one agreement header (:func:`.validation.agree`, 80 control
bytes to each peer) carries n, the method, the codec's identity (a CRC of its
repr, the method and server error feedback), the call counter, the tag and a local
error code (values not a 1-D float array of length n, bad seed or tag): a mismatch
or bad input on any rank raises :class:`ExchangeError` on every rank, never a hang.
"""
import zlib
from dataclasses import dataclass

import numpy as np

from horovod_sparse.quantize.codec import VALUE_DTYPE, derive_seed
from horovod_sparse.closing import ClosesOnExit

from .comm import CountingComm
from .errors import ExchangeError
from .traffic import Traffic
from .validation import TAG_ERROR_CODE, agree, as_numpy, is_int, tag_as_int64

METHODS = ("alltoall", "allgather")
AGGREGATES = ("sum", "majority")
_STATE_FORMAT = 1
# Local error codes in the header (2 is validation's "values must be a 1-D float array").
_BAD_VALUES, _BAD_LENGTH_OR_SEED = 2, 7


@dataclass(frozen=True)
class CompressedResult:
    """What one :meth:`CompressedAllreduce.allreduce` gave on this rank.

    values : float32 length n, the sum over ranks (bitwise identical on every rank).
    own : float32 length n, this rank's contribution as the receivers decode it
        (alltoall: chunk by chunk; allgather: the whole vector's code).
    traffic : :class:`~.traffic.Traffic` of this call on this rank.
    """

    values: np.ndarray
    own: np.ndarray
    traffic: Traffic


class CompressedAllreduce(ClosesOnExit):
    """Sum float32 vectors of length ``n`` over the ranks of ``comm``, carried as codes.

    Parameters
    ----------
    n : int >= 0
        Vector length (elements), the same on every rank.
    codec : :class:`~horovod_sparse.quantize.ValueCodec`
        The code (``encode``/``decode``/``nbytes``, ``aggregate`` "sum" or "majority").
    method : "alltoall" (default) or "allgather"; see the module docstring.
    comm : mpi4py communicator (default COMM_WORLD), duplicated here (a collective).
    server_error_feedback : bool (default False)
        "alltoall" with a "sum" codec only: the owner of a chunk keeps what its
        re-encoding lost and adds it to its next sum (1-bit Adam's server-side
        compensation). Part of the state.

    Every rank must call :meth:`allreduce` the same number of times, in the same order.
    """

    def __init__(self, n, codec, method="alltoall", comm=None, server_error_feedback=False):
        if not is_int(n) or n < 0:
            raise ValueError(f"n must be an integer >= 0, got {n!r}")
        if not all(callable(getattr(codec, f, None)) for f in ("encode", "decode", "nbytes")) \
                or getattr(codec, "aggregate", "sum") not in AGGREGATES:
            raise ValueError(f"codec must be a ValueCodec (encode/decode/nbytes, aggregate in "
                             f"{AGGREGATES}), got {codec!r}")
        if not isinstance(method, str) or method not in METHODS:
            raise ValueError(f"method must be one of {list(METHODS)}, got {method!r}")
        if not isinstance(server_error_feedback, (bool, np.bool_)):
            raise ValueError(f"server_error_feedback must be True or False, got {server_error_feedback!r}")
        majority = codec.aggregate == "majority"
        if server_error_feedback and (method != "alltoall" or majority):
            raise ValueError("server_error_feedback=True needs method 'alltoall' and a codec with "
                             f"aggregate 'sum', got method {method!r} and codec {codec!r}")
        if comm is None:
            from mpi4py import MPI
            comm = MPI.COMM_WORLD
        self.n, self.codec, self.method = int(n), codec, method
        self.majority = majority
        self.server_error_feedback = bool(server_error_feedback)
        self._identity = zlib.crc32(repr((repr(codec), getattr(codec, "name", ""), method,
                                          self.server_error_feedback)).encode())
        self._comm = CountingComm(comm)
        self.size, self.rank = self._comm.size, self._comm.rank
        P = self.size
        #: chunk j of the alltoall method is [bounds[j], bounds[j + 1])
        self.bounds = [j * self.n // P for j in range(P + 1)]
        self.chunk_sizes = [self.bounds[j + 1] - self.bounds[j] for j in range(P)]
        own = self.chunk_sizes[self.rank]
        self.server_residual = np.zeros(own, VALUE_DTYPE) if self.server_error_feedback else None
        self._calls = 0

    # -------------------------------------------------------------- the bound
    def payload_bytes_sent(self):
        """Payload bytes this rank sends per call (exact; see the module docstring)."""
        P, nbytes = self.size, self.codec.nbytes
        if self.method == "allgather":
            return (P - 1) * nbytes(self.n)
        return (sum(nbytes(s) for j, s in enumerate(self.chunk_sizes) if j != self.rank)
                + (P - 1) * nbytes(self.chunk_sizes[self.rank]))

    # ------------------------------------------------------------------ main
    def allreduce(self, values, seed, tag=0):
        """Sum ``values`` over the ranks; returns a :class:`CompressedResult`.

        values : 1-D float16/32/64 array (numpy or CPU torch tensor) of length n,
            encoded as float32.
        seed : int, the call's seed (every rank the same; the per-rank, per-chunk
            seeds are derived from it as the module docstring says). Negative seeds
            are taken modulo 2**64.
        tag : int in [-2**63, 2**63), the caller's check value (e.g. a CRC of the
            gradient layout); every rank must pass the same.
        Raises ExchangeError on every rank if any rank's input is bad or the ranks
        disagree on n, method, codec, call count or tag.
        """
        if self._comm.closed:
            raise RuntimeError("CompressedAllreduce is closed")
        before = self._comm.traffic
        x, error_code, detail = self._check(values)
        if not is_int(seed):
            error_code, detail = error_code or _BAD_LENGTH_OR_SEED, -1
            seed = 0
        seed = int(seed) % 2 ** 64
        tag_value = tag_as_int64(tag)
        if tag_value is None:
            tag_value, error_code = 0, error_code or TAG_ERROR_CODE
        header = dict(error_code=error_code, error_detail=detail, n=self.n,
                      algorithm=METHODS.index(self.method), k=-1, call=self._calls, value_dtype=1,
                      params=self._identity, count=x.size, tag=tag_value)
        self._calls += 1  # on every rank, also when the call is rejected
        try:
            agree(self._comm, header, METHODS)
        except ExchangeError as err:
            raise ExchangeError(str(err).replace("sparse allreduce", "compressed allreduce").replace(
                "invalid input", "values must have length n and seed must be an integer")) from None
        if self.method == "allgather":
            out, own = self._allgather(x, seed)
        else:
            out, own = self._alltoall(x, seed)
        return CompressedResult(out, own, self._comm.traffic - before)

    def _check(self, values):
        """(float32 values, error code, detail); never raises."""
        empty = np.zeros(0, VALUE_DTYPE)
        try:
            x = as_numpy(values)
        except Exception:
            return empty, _BAD_VALUES, 0
        if not isinstance(x, np.ndarray) or x.ndim != 1 or x.dtype.kind != "f":
            return empty, _BAD_VALUES, 0
        if x.size != self.n:
            return empty, _BAD_LENGTH_OR_SEED, x.size
        return np.ascontiguousarray(x, dtype=VALUE_DTYPE), 0, 0

    def _sum(self, codes, sizes, count):
        """Decode the P consecutive codes of ``count`` values (byte sizes ``sizes``) and sum
        them in rank order in float32 from zeros."""
        total = np.zeros(count, VALUE_DTYPE)
        offset = 0
        for size in sizes:
            total += self.codec.decode(codes[offset:offset + size], count)
            offset += size
        return total

    def _vote(self, total):
        """sign(total) as float32 +-1, sign(0) = +1."""
        return np.where(total >= 0, VALUE_DTYPE(1), VALUE_DTYPE(-1)).astype(VALUE_DTYPE)

    def _allgather(self, x, seed):
        P, codec = self.size, self.codec
        code = codec.encode(x, derive_seed(seed, self.rank))
        size = codec.nbytes(self.n)
        codes = self._comm.allgatherv(code, [size] * P)
        total = self._sum(codes, [size] * P, self.n)
        own = codec.decode(code, self.n)
        if self.majority:
            total = self._vote(total) * VALUE_DTYPE(P)
        return total, own

    def _alltoall(self, x, seed):
        P, rank, codec = self.size, self.rank, self.codec
        b, sizes = self.bounds, self.chunk_sizes
        pieces = [codec.encode(x[b[j]:b[j + 1]], derive_seed(seed, rank, j)) for j in range(P)]
        own = np.concatenate([codec.decode(p, s) for p, s in zip(pieces, sizes)]
                             + [np.zeros(0, VALUE_DTYPE)])
        send_counts = [codec.nbytes(s) for s in sizes]
        mine = sizes[rank]
        recv_counts = [codec.nbytes(mine)] * P
        received = self._comm.alltoallv(np.concatenate(pieces + [np.zeros(0, np.uint8)]),
                                        send_counts, recv_counts)
        total = self._sum(received, recv_counts, mine)
        if self.majority:
            total = self._vote(total)
        if self.server_error_feedback:
            total = total + self.server_residual
        code = codec.encode(total, derive_seed(seed, P + rank, rank))
        if self.server_error_feedback:
            self.server_residual = total - codec.decode(code, mine)
        chunks = self._comm.allgatherv(code, send_counts)
        out, offset = [], 0
        for size, nbytes in zip(sizes, send_counts):
            out.append(codec.decode(chunks[offset:offset + nbytes], size))
            offset += nbytes
        out = np.concatenate(out + [np.zeros(0, VALUE_DTYPE)]).astype(VALUE_DTYPE, copy=False)
        if self.majority:
            out = out * VALUE_DTYPE(P)
        return out, own

    # ----------------------------------------------------------------- state
    @property
    def traffic(self):
        """Cumulative :class:`Traffic` of this exchange on this rank."""
        return self._comm.traffic

    @property
    def calls(self):
        """Number of allreduce calls made (the agreed call counter)."""
        return self._calls

    def state_dict(self):
        """numpy/int-only dict: identity, call counter, server residual (empty if none)."""
        residual = self.server_residual
        return {"format": _STATE_FORMAT, "n": self.n, "world_size": self.size, "calls": self._calls,
                "method": METHODS.index(self.method),
                "server_residual": (np.zeros(0, VALUE_DTYPE) if residual is None else residual.copy())}

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n, method and world size; each rank its own)."""
        for key, mine in (("format", _STATE_FORMAT), ("n", self.n), ("world_size", self.size),
                          ("method", METHODS.index(self.method))):
            if int(d.get(key, -1)) != mine:
                raise ValueError(f"state_dict {key} is {d.get(key)!r}, this exchange has {mine!r}")
        if self.server_error_feedback:
            residual = np.asarray(d["server_residual"], dtype=VALUE_DTYPE)
            if residual.shape != self.server_residual.shape:
                raise ValueError(f"state_dict server_residual has shape {residual.shape}, "
                                 f"expected {self.server_residual.shape}")
            self.server_residual = residual.copy()
        self._calls = int(d["calls"])

    # --------------------------------------------------------------- closing
    def close(self):
        """Free the duplicated communicator (idempotent)."""
        self._comm.free()

    def __repr__(self):
        return (f"CompressedAllreduce(n={self.n}, codec={self.codec!r}, method={self.method!r}, "
                f"server_error_feedback={self.server_error_feedback})")
