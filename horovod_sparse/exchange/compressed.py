"""Allreduce of dense float32 vectors carried as codes (quantizers): alltoall or allgather.

The vectors stay on their own device (numpy, or torch on CPU/CUDA): encoding and
decoding run there (the codec's ``encode``/``decode``), and only the codes cross to
the host (:func:`~horovod_sparse.ops.host.to_host`/``from_host``) for mpi4py. Two
exchanges, both over :class:`~.comm.CountingComm` (every byte counted):

* ``"alltoall"`` (DeepSpeed 1-bit Adam's compressed allreduce; volume per rank about
  2 (P-1)/P * nbytes(n), independent of P): the vector is cut into P chunks, chunk
  j = [b_j, b_{j+1}) belonging to rank j, b_j = (j * (n // u) // P) * u for 0 < j < P
  (b_0 = 0, b_P = n), u the codec's ``chunk_unit`` (1 unless it says otherwise: j*n//P).
  A code with buckets gives its bucket size, so that the chunks start at a bucket's start
  and every bucket holds the same values as in one code of the whole vector.

  1. Every rank encodes each chunk j with seed ``derive_seed(seed, rank, j)`` and sends
     it to its owner (one Alltoallv; sizes come from ``codec.nbytes``, so no size
     exchange). What it sent, as decoded, is its ``own`` contribution.
  2. The owner decodes the P pieces of its chunk and sums them in rank order in float32
     (from the first piece; its own piece is its ``own`` chunk, not decoded again).
  3. It adds its server residual (server error feedback), re-encodes the sum with seed
     ``derive_seed(seed, P + rank, rank)`` and, once the call has succeeded, keeps
     ``sum + residual - decode(code)`` as the new residual. A majority code keeps only
     signs, so the code of the sum is the code of its vote.
  4. One Allgatherv of the encoded chunks, and every rank decodes every chunk: the same
     bytes decoded by the same pure function, so the result is bitwise identical on
     every rank (majority: times P).

  Payload bytes sent per rank, exactly:
  ``sum_{j != rank} nbytes(|chunk j|) + (P - 1) * nbytes(|chunk rank|)``.

  At P = 2 steps 2-4 become one Allgatherv of every rank's chunk codes (the same
  bytes per rank, nbytes(chunk 0) + nbytes(chunk 1)), and every rank sums the decoded
  pieces of every chunk in rank order (majority: P * sign(sum), sign(0) = +1): the
  owners' re-encoding would only add a second rounding and passes, never save bytes.
  So at P = 2 the sum is quantized once and the server residual stays zero. So it is at
  P = 1: no bytes move, and the result is this rank's code decoded (the owner's re-encoding
  of its own decoded chunk would add a rounding and two passes, nothing else).

* ``"allgather"`` (GRACE's allgather communicator; volume (P-1) * nbytes(n), grows
  with P): every rank encodes its whole vector with seed ``derive_seed(seed, rank)``,
  one Allgatherv, and every rank decodes all P codes and sums them in rank order in
  float32 (from the first). Majority: the result is ``P * sign(sum)``, sign(0) = +1.
  Payload bytes sent per rank, exactly: ``(P - 1) * nbytes(n)``.

Passes over the n values per call (alltoall): encode (which also writes ``own``), the
owner's decoding and summing of 1/P of the buffer P times, the re-encode of 1/P, the
decoding of the result (P = 2: encode, decode the peer's codes, one add; a 1-bit code on the
CPU: encode, then both codes decoded and added in one pass; P = 1: the encode alone, which
writes the result); nothing of size n leaves the device.

TensorFlow tensors (the quantizers' step as TensorFlow ops on the gradients' device): the
same steps, with the codec's and the kernels' TensorFlow spellings, which return new
tensors instead of writing into this exchange's buffers (chunks are joined by concatenation);
only the codes cross to numpy (:func:`~horovod_sparse.ops.host.to_host`).

Before any data moves, one agreement header (:func:`.validation.agree_call`, 80 control
bytes to each peer) carries n, the method, the codec's identity (a CRC of its repr, the
method and server error feedback), the call counter, the tag and a local error code
(values not a 1-D float array of length n, bad seed or tag): a mismatch or bad input on
any rank raises :class:`ExchangeError` on every rank, never a hang.
"""
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from horovod_sparse.memory import ErrorFeedback
from horovod_sparse.ops import cpu, host, kernels, namespace, views
from horovod_sparse.ops.cpu import memory as memory_kernels
from horovod_sparse.pipeline import check_identity, saved_array

from .comm import CountedExchange, CountingComm, Traffic
from .seeds import derive_seed
from .validation import identity_code, is_int

METHODS = ("alltoall", "allgather")
AGGREGATES = ("sum", "majority")
_STATE_FORMAT = 1
# Local error codes in the header (2 is validation's "values must be a 1-D float array").
_BAD_VALUES, _BAD_LENGTH_OR_SEED = 2, 7
_ERROR_TEXTS = {_BAD_LENGTH_OR_SEED: "values must have length n and seed must be an integer "
                                     "(length {detail})"}


@dataclass(frozen=True)
class CompressedResult:
    """What one :meth:`CompressedAllreduce.allreduce` gave on this rank.

    values : float32 length n, the sum over ranks (bitwise identical on every rank), a
        new array in the input's library and device.
    own : float32 length n, this rank's contribution as the receivers decode it
        (alltoall: chunk by chunk; allgather: the whole vector's code), or None if not
        asked for; a buffer of the exchange, valid until its next call.
    traffic : :class:`~.traffic.Traffic` of this call on this rank.
    """

    values: Any
    own: Any
    traffic: Traffic


class CompressedAllreduce(CountedExchange):
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
        self._params_code = identity_code(repr(codec), getattr(codec, "name", ""), method,
                                          self.server_error_feedback)
        self._comm = CountingComm(comm)
        self.size, self.rank = self._comm.size, self._comm.rank
        P = self.size
        #: chunk j of the alltoall method is [bounds[j], bounds[j + 1])
        unit = getattr(codec, "chunk_unit", 1)
        self.bounds = [0] + [j * (self.n // unit) // P * unit for j in range(1, P)] + [self.n]
        self.chunk_sizes = [self.bounds[j + 1] - self.bounds[j] for j in range(P)]
        #: bytes of each chunk's code, and where each starts in a buffer of all of them
        self.chunk_nbytes = [codec.nbytes(s) for s in self.chunk_sizes]
        self._code_offsets = np.concatenate(([0], np.cumsum(self.chunk_nbytes))).astype(int).tolist()
        self._server = ErrorFeedback(self.chunk_sizes[self.rank], enabled=self.server_error_feedback)
        self._scratch = {}
        self._residual = None  # this call's residual buffer (allreduce's argument)
        self._out = None  # this call's result buffer (allreduce's argument), or None: a new one
        self._last_codes = None  # (this rank's codes of the last call, its values): decoded_own

    # -------------------------------------------------------------- the bound
    def payload_bytes_sent(self):
        """Payload bytes this rank sends per call (exact; see the module docstring)."""
        P, nbytes = self.size, self.codec.nbytes
        if self.method == "allgather":
            return (P - 1) * nbytes(self.n)
        return (sum(nbytes(s) for j, s in enumerate(self.chunk_sizes) if j != self.rank)
                + (P - 1) * nbytes(self.chunk_sizes[self.rank]))

    # ------------------------------------------------------------------ main
    def allreduce(self, values, seed, tag=0, want_own=True, finite=True, residual=None, out=None):
        """Sum ``values`` over the ranks; returns a :class:`CompressedResult`.

        values : 1-D float16/32/64 array of length n, numpy or a torch tensor on any
            device, encoded as float32; the result is in the same library and device.
        seed : int, the call's seed (every rank the same; the per-rank, per-chunk
            seeds are derived from it as the module docstring says). Negative seeds
            are taken modulo 2**64.
        tag : int in [-2**63, 2**63), the caller's check value (e.g. a CRC of the
            gradient layout); every rank must pass the same.
        want_own : False skips ``own`` (result.own is None): one pass less.
        finite : False when the caller's values hold an inf or a NaN: every rank then raises
            NonFiniteGradientError, no data moves and nothing here advances.
        residual : None, or a float32 buffer of n (numpy or a CPU tensor, ``values`` itself
            allowed; a codec with ``fused_cpu``) that gets ``values - own`` (error feedback's
            next residual) in the encoding pass, chunk by chunk, without ``own`` being read back.
        out : None (the result is a new array), or a float32 buffer of n like ``values`` that
            gets the result (a caller that copies the result out at once and reuses the buffer
            step to step: no fresh memory for the kernel to zero). TensorFlow: not used.
        Raises ExchangeError on every rank if any rank's input is bad or the ranks
        disagree on n, method, codec, call count or tag; the server residual is then
        unchanged.
        """
        call = self._next_call()
        before = self._comm.traffic
        x, error_code, detail = self._check(values)
        if not is_int(seed):
            error_code, detail, seed = error_code or _BAD_LENGTH_OR_SEED, -1, 0
        seed = int(seed) % 2 ** 64
        self._agree(call, n=self.n, tag=tag, params=self._params_code,
                    error_code=error_code, error_detail=detail, algorithm=METHODS.index(self.method),
                    count=-1 if x is None else x.shape[0], algorithm_names=METHODS,
                    exchange="compressed allreduce", error_texts=_ERROR_TEXTS, finite=finite)
        self._residual = residual if residual is not None and not namespace.is_tensorflow(x) else None
        self._out = out if out is not None and not namespace.is_tensorflow(x) else None
        try:
            if self.method == "allgather":
                out, own = self._allgather(x, seed)
            else:
                out, own = self._alltoall(x, seed, want_own)
        finally:  # the caller's buffers are the call's only: holding them would keep them from reuse
            self._residual = self._out = None
        return CompressedResult(out, own if want_own else None, self._comm.traffic - before)

    def _check(self, values):
        """(float32 values or None, error code, detail); never raises."""
        try:
            if namespace.is_tensorflow(values):
                if len(values.shape) != 1 or not values.dtype.is_floating:
                    return None, _BAD_VALUES, 0
                if values.shape[0] != self.n:
                    return None, _BAD_LENGTH_OR_SEED, values.shape[0]
                return sys.modules["tensorflow"].cast(values, "float32"), 0, 0
            x = values.detach() if namespace.is_torch(values) else np.asarray(values)
            floating = namespace.namespace(x).isdtype(x.dtype, "real floating")
            if x.ndim != 1 or not floating:
                return None, _BAD_VALUES, 0
            if x.shape[0] != self.n:
                return None, _BAD_LENGTH_OR_SEED, x.shape[0]
            if namespace.is_torch(x):
                return x.to(namespace.dtype_of(x, "float32")).contiguous(), 0, 0
            return np.ascontiguousarray(x, dtype=np.float32), 0, 0
        except Exception:
            return None, _BAD_VALUES, 0

    def _buffer(self, name, count, dtype_name, like):
        """A scratch buffer reused from call to call (one per name, library and device); None
        for TensorFlow (its kernels return new tensors)."""
        if namespace.is_tensorflow(like):
            return None
        key = (name, dtype_name, str(getattr(like, "device", "numpy")), namespace.is_torch(like))
        buffer = self._scratch.get(key)
        if buffer is None or buffer.shape[0] < count:
            buffer = self._scratch[key] = namespace.empty(max(count, 1), dtype_name, like)
        return buffer[:count]

    def _result(self, like):
        """Where this call's sum goes: the caller's ``out``, else a new array."""
        return namespace.new_empty(self.n, "float32", like) if self._out is None else self._out

    def _code(self, codes, j):
        """The code of chunk j in a buffer holding every chunk's code back to back."""
        return codes[self._code_offsets[j]:self._code_offsets[j + 1]]

    def _encode_chunks(self, x, seed, decoded):
        """1. Every chunk's code, back to back; chunk j's decoded floats go to ``decoded(j)``
        (a float32 buffer, or None where nobody needs them). TensorFlow: ``decoded(j)`` True
        where they are needed; returns ``(codes, [decoded floats or None per chunk])``."""
        P, rank, b = self.size, self.rank, self.bounds
        if namespace.is_tensorflow(x):
            pairs = [self.codec.encode_decoded(x[b[j]:b[j + 1]], derive_seed(seed, rank, j)) if decoded(j)
                     else (self.codec.encode(x[b[j]:b[j + 1]], derive_seed(seed, rank, j)), None)
                     for j in range(P)]
            return sys.modules["tensorflow"].concat([code for code, _ in pairs], 0), [f for _, f in pairs]
        codes = self._buffer("codes", self._code_offsets[-1], "uint8", x)
        residual = {} if self._residual is None else {"residual": None}
        for j in range(P):
            if residual:
                residual["residual"] = self._residual[b[j]:b[j + 1]]
            self.codec.encode(x[b[j]:b[j + 1]], derive_seed(seed, rank, j), out=self._code(codes, j),
                              decoded=decoded(j), **residual)
        return codes

    def _alltoall(self, x, seed, want_own):
        P, rank, codec, b = self.size, self.rank, self.codec, self.bounds
        if P == 1:
            return self._one_rank(x, seed, want_own)
        if P == 2:
            return self._two_ranks(x, seed, want_own)
        if namespace.is_tensorflow(x):
            return self._alltoall_tensorflow(x, seed, want_own)
        own = self._buffer("own", self.n, "float32", x) if want_own else None
        own_chunk = own[b[rank]:b[rank + 1]] if want_own else \
            self._buffer("own_chunk", self.chunk_sizes[rank], "float32", x)
        codes = self._encode_chunks(x, seed, lambda j: own_chunk if j == rank else
                                    None if own is None else own[b[j]:b[j + 1]])
        self._last_codes = (codes, x)
        mine = self.chunk_nbytes[rank]
        received = host.from_wire(self._comm.alltoallv(host.to_wire(codes, self._comm), self.chunk_nbytes,
                                                       [mine] * P), x)
        # 2. the owner's sum of the P decoded pieces of its chunk
        total = self._sum_pieces(received, own_chunk, x)
        # 3. plus the server residual, re-encoded; what it decodes to is the result's chunk
        fused = self._server_fused(total)
        acc = self._server.accumulate(total) if fused is None else fused
        out = self._result(x)
        code = self._buffer("owner_code", mine, "uint8", x)
        codec.encode(acc, derive_seed(seed, P + rank, rank), out=code, decoded=out[b[rank]:b[rank + 1]],
                     **({} if fused is None else {"residual": acc}))
        # 4. every chunk's code to every rank; decode the others' chunks
        gathered = host.from_wire(self._comm.allgatherv(host.to_wire(code, self._comm), self.chunk_nbytes), x)
        if fused is None:
            self._server.commit_minus(acc, out[b[rank]:b[rank + 1]])
        else:
            self._server.commit_spare("residual")
        for j in range(P):
            if j != rank:
                codec.decode(self._code(gathered, j), self.chunk_sizes[j], out=out[b[j]:b[j + 1]])
        if self.majority and P != 1:  # times 1 is the identity: no pass
            out *= P
        return out, own

    def _server_fused(self, total):
        """The server's acc = total + residual by the compiled kernel into the residual's spare
        (:mod:`horovod_sparse.ops.cpu.memory`), where it applies (server error feedback on, the
        kernels on, a CPU buffer, a codec with ``fused_cpu``); the encode then writes the next
        residual into that spare in its pass and the commit is a swap. None elsewhere."""
        view = views.numpy_view(total)
        if not (self.server_error_feedback and view is not None and getattr(self.codec, "fused_cpu", False)
                and cpu.enabled()):
            return None
        state, spare = self._server.buffers("residual", total)
        memory_kernels.accumulate_finite(view, views.numpy_view(state), views.numpy_view(spare))
        return spare

    def _alltoall_tensorflow(self, x, seed, want_own):
        """:meth:`_alltoall` (P >= 3) in TensorFlow's new tensors: the same steps and seeds."""
        tf, P, rank, codec = sys.modules["tensorflow"], self.size, self.rank, self.codec
        codes, own = self._encode_chunks(x, seed, lambda j: want_own or j == rank)
        mine = self.chunk_nbytes[rank]
        received = host.from_wire(self._comm.alltoallv(host.to_wire(codes, self._comm), self.chunk_nbytes,
                                                       [mine] * P), x)
        total = self._sum_pieces(received, own[rank], x)
        acc = self._server.accumulate(total)
        code, result = codec.encode_decoded(acc, derive_seed(seed, P + rank, rank))
        gathered = host.from_wire(self._comm.allgatherv(host.to_wire(code, self._comm), self.chunk_nbytes), x)
        self._server.commit_minus(acc, result)
        out = tf.concat([result if j == rank else codec.decode(self._code(gathered, j), self.chunk_sizes[j])
                         for j in range(P)], 0)
        if self.majority:
            out = out * np.float32(P)
        return out, tf.concat(own, 0) if want_own else None

    def _one_rank(self, x, seed, want_own):
        """The alltoall method at P = 1 (module docstring): the result is this rank's code
        decoded, written by the encode; the sum is quantized once, as at P = 2."""
        if namespace.is_tensorflow(x):
            _, decoded = self._encode_chunks(x, seed, lambda j: True)
            return decoded[0], decoded[0]
        out = self._result(x)
        self._last_codes = (self._encode_chunks(x, seed, lambda j: out), x)
        return out, _copy(self._buffer("own", self.n, "float32", x), out) if want_own else None

    def _two_ranks(self, x, seed, want_own):
        """The alltoall method at P = 2 (module docstring): one Allgatherv of both ranks' chunk
        codes; each chunk's sum is decoded straight into the result, plus this rank's own
        (or, where the codec sums two codes in one pass and ``own`` is not wanted, both codes
        decoded and added at once). A majority code's vote of two is computed on the codes
        (``codec.vote_of_two``): one decode, no sum."""
        rank, b, codec = self.rank, self.bounds, self.codec
        vote_of_two = getattr(codec, "vote_of_two", None) if self.majority else None
        if namespace.is_tensorflow(x):
            return self._two_ranks_tensorflow(x, seed, want_own, vote_of_two)
        sum_codes = vote_of_two is None and not want_own and codec.sums_two_codes(x)
        own = (self._buffer("own", self.n, "float32", x) if want_own or (vote_of_two is None and not sum_codes)
               else None)
        codes = self._encode_chunks(x, seed, lambda j: None if own is None else own[b[j]:b[j + 1]])
        self._last_codes = (codes, x)
        whole = self._code_offsets[-1]
        gathered = self._comm.allgatherv(host.to_wire(codes, self._comm), [whole, whole])
        peer = host.from_wire(gathered[(1 - rank) * whole:(2 - rank) * whole], x)  # only the peer's
        out = self._result(x)
        if sum_codes:
            first, second = (codes, peer) if rank == 0 else (peer, codes)  # rank order
            for j in range(2):
                codec.decode_sum_of_two(self._code(first, j), self._code(second, j), self.chunk_sizes[j],
                                        out=out[b[j]:b[j + 1]])
            if self.majority:
                self._vote(out)
            return out, own
        if vote_of_two is not None:
            voted = vote_of_two(codes, peer, out=self._buffer("voted", whole, "uint8", x))
            for j in range(2):
                codec.decode(self._code(voted, j), self.chunk_sizes[j], out=out[b[j]:b[j + 1]])
            views.kernel_view(out)[...] *= 2  # P * sign: exact
            return out, own
        for j in range(2):
            total, mine = out[b[j]:b[j + 1]], own[b[j]:b[j + 1]]
            codec.decode(self._code(peer, j), self.chunk_sizes[j], out=total)
            _add_into(total, *((mine, total) if rank == 0 else (total, mine)))  # rank order
        if self.majority:
            self._vote(out)
        return out, own

    def _two_ranks_tensorflow(self, x, seed, want_own, vote_of_two):
        """:meth:`_two_ranks` in TensorFlow's new tensors: the same codes, vote and sums."""
        tf, rank, codec = sys.modules["tensorflow"], self.rank, self.codec
        codes, own = self._encode_chunks(x, seed, lambda j: want_own or vote_of_two is None)
        whole = self._code_offsets[-1]
        gathered = self._comm.allgatherv(host.to_wire(codes, self._comm), [whole, whole])
        peer = host.from_wire(gathered[(1 - rank) * whole:(2 - rank) * whole], x)
        if vote_of_two is not None:
            voted = vote_of_two(codes, peer, out=None)
            out = tf.concat([codec.decode(self._code(voted, j), self.chunk_sizes[j]) for j in range(2)], 0)
            return out * np.float32(2), tf.concat(own, 0) if want_own else None  # P * sign: exact
        sums = []
        for j in range(2):
            theirs = codec.decode(self._code(peer, j), self.chunk_sizes[j])
            sums.append(own[j] + theirs if rank == 0 else theirs + own[j])  # rank order
        out = tf.concat(sums, 0)
        if self.majority:
            out = self._vote(out)
        return out, tf.concat(own, 0)

    def _sum_pieces(self, received, own_chunk, like):
        """Decode the P pieces of this rank's chunk (``received``, in rank order) and add them
        in rank order in float32, from the first; this rank's piece is ``own_chunk``."""
        count, nbytes = self.chunk_sizes[self.rank], self.chunk_nbytes[self.rank]
        total = self._buffer("total", count, "float32", like)

        def piece(r, into):
            if r == self.rank:
                return own_chunk
            return self.codec.decode(received[r * nbytes:(r + 1) * nbytes], count, out=into)

        first = piece(0, total)
        if self.size == 1:
            return first
        if namespace.is_tensorflow(like):  # new tensors, added in rank order from the first
            for r in range(1, self.size):
                first = first + piece(r, None)
            return first
        spare = self._buffer("piece", count, "float32", like)
        namespace.backend(total).add(first, piece(1, total if first is own_chunk else spare), out=total)
        for r in range(2, self.size):
            total += piece(r, spare)
        return total

    def _allgather(self, x, seed):
        P, rank, codec, n = self.size, self.rank, self.codec, self.n
        size = codec.nbytes(n)
        if namespace.is_tensorflow(x):  # new tensors: decoded and added in rank order from the first
            code, own = codec.encode_decoded(x, derive_seed(seed, rank))
            gathered = host.from_wire(self._comm.allgatherv(host.to_wire(code, self._comm), [size] * P), x)
            out = None
            for r in range(P):
                piece = own if r == rank else codec.decode(gathered[r * size:(r + 1) * size], n)
                out = piece if out is None else out + piece
            return (self._vote(out) if self.majority else out), own
        code = self._buffer("codes", size, "uint8", x)
        own = self._buffer("own", n, "float32", x)
        codec.encode(x, derive_seed(seed, rank), out=code, decoded=own,
                     **({} if self._residual is None else {"residual": self._residual}))
        self._last_codes = (code, x)
        gathered = host.from_wire(self._comm.allgatherv(host.to_wire(code, self._comm), [size] * P), x)
        out = self._result(x)
        for r in range(P):
            if r == 0:
                if r == rank:
                    _copy(out, own)
                else:
                    codec.decode(gathered[:size], n, out=out)
            else:
                out += own if r == rank else codec.decode(gathered[r * size:(r + 1) * size], n,
                                                          out=self._buffer("piece", n, "float32", x))
        if self.majority:
            self._vote(out)
        return out, own

    def decoded_own(self):
        """This rank's contribution to the last call as the receivers decode it: what
        ``want_own`` returns, decoded now from that call's codes (a CPU or device buffer of
        this exchange until its next call). For a caller that skipped ``own`` (the codec sums
        the codes, or the encode wrote the residual) and may still ask for it."""
        codes, like = self._last_codes
        own = namespace.new_empty(self.n, "float32", like)
        if self.method == "allgather":
            return self.codec.decode(codes, self.n, out=own)
        for j in range(self.size):
            self.codec.decode(self._code(codes, j), self.chunk_sizes[j], out=own[self.bounds[j]:self.bounds[j + 1]])
        return own

    def _vote(self, total):
        """total = P * sign(total), sign(0) = +1, in place: the sign bit of P set where total < 0.
        (TensorFlow: a new tensor, the same bits.)"""
        if namespace.is_tensorflow(total):
            tf = sys.modules["tensorflow"]
            sign = tf.bitwise.left_shift(tf.cast(total < 0, tf.int32), 31)
            return tf.bitcast(tf.bitwise.bitwise_xor(sign, int(np.float32(self.size).view(np.int32))), tf.float32)
        negative = self._buffer("negative", total.shape[0], "bool", total)
        kernels.less_into(total, 0, negative)
        as_int = total.view(namespace.dtype_of(total, "int32"))
        as_int[...] = negative
        as_int <<= 31
        as_int ^= int(np.float32(self.size).view(np.int32))
        return total

    # ----------------------------------------------------------------- state
    @property
    def server_residual(self):
        """The owner's residual (float32, this rank's chunk; the live buffer), or None."""
        return self._server.residual if self.server_error_feedback else None

    def state_dict(self):
        """numpy/int-only dict: identity, call counter, server residual (empty if none)."""
        residual = (self._server.state_dict()["residual"] if self.server_error_feedback
                    else np.zeros(0, np.float32))
        return {**self._identity(), "calls": self._calls, "server_residual": residual}

    def load_state_dict(self, d):
        """Restore :meth:`state_dict` (same n, method and world size; each rank its own)."""
        check_identity(d, self._identity(), "CompressedAllreduce")
        if self.server_error_feedback:
            residual = saved_array(d, "server_residual", (self.chunk_sizes[self.rank],))
            self._server.load_state_dict({"residual": residual})
        self._calls = int(d["calls"])

    def _identity(self):
        return {"format": _STATE_FORMAT, "n": self.n, "world_size": self.size,
                "method": METHODS.index(self.method)}

    def __repr__(self):
        return (f"CompressedAllreduce(n={self.n}, codec={self.codec!r}, method={self.method!r}, "
                f"server_error_feedback={self.server_error_feedback})")


def _add_into(target, first, second):
    """target = first + second in float32; on the CPU through numpy's views (torch's one-thread
    add is ~2x slower here), the same IEEE sums."""
    view = views.kernel_view
    namespace.backend(view(target)).add(view(first), view(second), out=view(target))


def _copy(target, source):
    """target[...] = source (same dtype); returns target."""
    target[...] = source
    return target
