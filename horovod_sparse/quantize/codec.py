"""The value codec: how a float32 vector becomes bytes on the wire and back.

Every quantizer (and the FFT compressor's range-based float) is a :class:`ValueCodec`.
The exchanges that carry codes (:mod:`horovod_sparse.exchange.compressed`, and the
sparse engine's ``value_codec``) only ever see ``encode``/``decode``/``nbytes``, so a
new code is one small class.

Contract, relied on by every exchange:

* ``encode(values, seed)`` takes a 1-D float32 array and returns a 1-D ``uint8``
  array of exactly ``nbytes(values.size)`` bytes. It is deterministic given
  ``(values, seed)``: stochastic codes draw from ``np.random.default_rng(seed)``.
* ``decode(data, count)`` returns a new 1-D float32 array of ``count`` values. It is
  a pure function of the bytes, so every rank decoding the same bytes gets bitwise
  the same floats.
* ``nbytes(count)`` depends only on ``count`` (and the codec's parameters), so a
  receiver can size its buffers without asking.
* ``aggregate`` says how decoded contributions combine: ``"sum"`` (the default), or
  ``"majority"`` (signSGD's vote: the result is P * sign(sum), sign(0) = +1).
"""
import numpy as np

VALUE_DTYPE = np.float32


def derive_seed(*parts):
    """One 63-bit seed from a few non-negative ints (base seed, step, rank, chunk, ...).

    Uses numpy's SeedSequence, so nearby inputs give unrelated streams.
    """
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


class ValueCodec:
    """Base class: a code for 1-D float32 vectors. See the module docstring."""

    name = "abstract"
    #: True if ``encode`` draws random numbers (stochastic rounding)
    stochastic = False
    #: "sum" or "majority"
    aggregate = "sum"

    def encode(self, values, seed=0):
        raise NotImplementedError

    def decode(self, data, count):
        raise NotImplementedError

    def nbytes(self, count):
        raise NotImplementedError

    def roundtrip(self, values, seed=0):
        """``decode(encode(values, seed))``: what a receiver would see."""
        values = np.ascontiguousarray(values, dtype=VALUE_DTYPE)
        return self.decode(self.encode(values, seed), values.size)

    def __repr__(self):
        return f"{type(self).__name__}()"


class Float32Codec(ValueCodec):
    """No compression: the float32 bytes themselves (4 bytes per value)."""

    name = "float32"

    def encode(self, values, seed=0):
        return np.ascontiguousarray(values, dtype=VALUE_DTYPE).view(np.uint8).copy()

    def decode(self, data, count):
        return np.frombuffer(np.ascontiguousarray(data, dtype=np.uint8).tobytes(), VALUE_DTYPE,
                             count=count).copy()

    def nbytes(self, count):
        return 4 * int(count)
