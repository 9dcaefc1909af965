"""Range-based floating point: a low-bit float whose exponent window follows the data.

The code of the FFT compressor (Wang et al., HPDC'20): values are cut into blocks of
``block_size`` consecutive values; each block stores one header byte, the float32
biased exponent of its largest magnitude (after rounding), and every value is

    sign (1 bit) | E (e bits) | M (m bits)

E = 0 (with M = 0) is the reserved code for zero / underflow; E in [1, 2**e - 1] is
the exponent counted upward from the bottom of the block's window, so the window is
the 2**e - 1 binades just below and including the block's top binade and no code is
wasted on exponents that never occur in the block. M is the mantissa rounded to
nearest (ties away from zero, done in integer arithmetic on the float32 bits, so it
is exact and deterministic; a mantissa that rounds up carries into the exponent).

Widths (``bits``) and their split, with the relative error bound for a value inside
the window and the size of the window:

    ====  ===  ===  ===============  ====================  =================================
    bits   e    m   binades (2**e-1)  relative error bound  flush-to-zero below (x 2**top)
    ====  ===  ===  ===============  ====================  =================================
      4    2    1          3          2**-2  = 0.25          2**-2
      8    4    3         15          2**-4  = 0.0625        2**-14
     12    4    7         15          2**-8  ~ 0.0039        2**-14
     16    5   10         31          2**-11 ~ 0.00049       2**-30
    ====  ===  ===  ===============  ====================  =================================

with 2**top the block's top binade (2**top <= rounded max |x| of the block < 2**(top+1)).

Guarantees, per value x of a block (x finite float32):

* inside the window (rounded |x| >= 2**(top - 2**e + 2), the smallest representable
  magnitude of the block): |decode - x| <= 2**-(m+1) * |x|, the sign is kept;
* below the window: decoded as exactly 0 (flush to zero), so
  |decode - x| = |x| < 2**(top - 2**e + 2) <= 2**-(2**e - 2) * (1 + 2**-(m+1)) * max|block|;
* 0 (and -0) decode as +0; float32 subnormals (|x| < 2**-126) are flushed to 0;
* finite values that would round to 2**128 saturate at the largest finite code,
  (2 - 2**-m) * 2**127.

Non-finite values: +-inf decode as +-inf and NaN as NaN (top exponent, like IEEE), and
they set the block's window to the top float32 binade, so the finite values of a block
holding an inf or NaN are flushed to zero (a broken gradient stays visibly broken
instead of being silently repaired). Nothing here raises on data: encoders run inside
collective exchanges, where a raise on one rank would leave the others waiting.

Size: ``nbytes(count) = ceil(count / block_size) + ceil(count * bits / 8)`` (header
bytes first, then the codes bit-packed as one little-endian bit stream by
:mod:`horovod_sparse.quantize.bitpack`). Deterministic: ``seed`` is ignored.
"""
import numpy as np

from .bitpack import pack, unpack
from .codec import VALUE_DTYPE, ValueCodec

#: bits -> (exponent bits e, mantissa bits m); the sign takes the remaining bit
SPLITS = {4: (2, 1), 8: (4, 3), 12: (4, 7), 16: (5, 10)}
_MAG_MASK = np.uint32(0x7FFFFFFF)


class RangeFloatCodec(ValueCodec):
    """Range-based float code of ``bits`` bits per value (see the module docstring).

    bits : one of 4, 8, 12, 16 (bits per value, sign included).
    block_size : int >= 1, values sharing one exponent window (one header byte each);
        default 256, i.e. 1/32 bit per value of overhead.
    """

    name = "rangefloat"

    def __init__(self, bits=8, block_size=256):
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in SPLITS:
            raise ValueError(f"bits must be one of {sorted(SPLITS)}, got {bits!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) \
                or not 1 <= block_size <= 2**31 - 1:
            raise ValueError(f"block_size must be an integer in [1, {2**31 - 1}], got {block_size!r}")
        self.bits, self.block_size = int(bits), int(block_size)
        self.exponent_bits, self.mantissa_bits = SPLITS[self.bits]

    # ---------------------------------------------------------------- bounds
    @property
    def relative_error(self):
        """Bound on |decode - x| / |x| for x inside its block's window: 2**-(m+1)."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def binades(self):
        """Number of binades in a block's window: 2**e - 1."""
        return 2 ** self.exponent_bits - 1

    def smallest(self, block_max):
        """Smallest nonzero magnitude representable in a block whose largest |x| is ``block_max``
        (values whose rounded magnitude is below it are flushed to 0)."""
        q = self.roundtrip(np.array([block_max], dtype=VALUE_DTYPE))[0]
        top = np.frexp(np.float64(abs(q)))[1] - 1
        return float(2.0 ** (top - self.binades + 1))

    def nbytes(self, count):
        count = int(count)
        return -(-count // self.block_size) + -(-count * self.bits // 8)

    # ----------------------------------------------------------------- codes
    def encode(self, values, seed=0):
        e, m = self.exponent_bits, self.mantissa_bits
        values = np.ascontiguousarray(values, dtype=VALUE_DTYPE).ravel()
        count = values.size
        if count == 0:
            return np.empty(0, np.uint8)
        raw = values.view(np.uint32)
        sign = raw >> np.uint32(31)
        mag = raw & _MAG_MASK
        biased = mag >> np.uint32(23)
        finite = biased < 255
        nan = mag > np.uint32(0x7F800000)
        # Round the mantissa to m bits: add half an ulp of the target width to the
        # magnitude bits and truncate; a carry moves into the exponent, as it should.
        r = (mag.astype(np.uint64) + np.uint64(1 << (22 - m))) >> np.uint64(23 - m)
        r = np.minimum(r, np.uint64((254 << m) | ((1 << m) - 1)))  # saturate finite values
        r = np.where(finite, r, np.uint64(255 << m))                 # +-inf
        r = np.where(nan, np.uint64((255 << m) | 1), r)               # NaN stays NaN
        r = np.where(biased == 0, np.uint64(0), r).astype(np.int64)   # 0 and subnormals -> 0
        block_exp = r >> m                                            # biased exponent after rounding

        blocks = -(-count // self.block_size)
        padded = np.zeros(blocks * self.block_size, np.int64)
        padded[:count] = block_exp
        top = padded.reshape(blocks, self.block_size).max(axis=1)   # header: 0..255
        window_top = np.repeat(top, self.block_size)[:count]
        code_exp = block_exp - window_top + (2 ** e - 1)              # 1..2**e-1 inside the window
        inside = (code_exp >= 1) & (r > 0)
        magnitude = np.where(inside, (code_exp << m) | (r & ((1 << m) - 1)), 0)
        codes = np.where(inside, (sign.astype(np.int64) << (e + m)) | magnitude, 0)
        return np.concatenate([top.astype(np.uint8), pack(codes.astype(np.uint32), self.bits)])

    def decode(self, data, count):
        e, m = self.exponent_bits, self.mantissa_bits
        count = int(count)
        if count == 0:
            return np.empty(0, VALUE_DTYPE)
        data = np.ascontiguousarray(data, dtype=np.uint8)
        blocks = -(-count // self.block_size)
        top = np.repeat(data[:blocks].astype(np.int64), self.block_size)[:count]
        codes = unpack(data[blocks:], self.bits, count).astype(np.int64)
        sign = codes >> (e + m)
        code_exp = (codes >> m) & ((1 << e) - 1)
        mantissa = codes & ((1 << m) - 1)
        biased = top - (2 ** e - 1) + code_exp
        nonzero = (code_exp > 0) & (biased > 0)
        raw = (sign << 31) | (np.clip(biased, 0, 255) << 23) | (mantissa << (23 - m))
        raw = np.where(nonzero, raw, 0).astype(np.uint32)
        return raw.view(VALUE_DTYPE).copy()

    def __repr__(self):
        return f"RangeFloatCodec(bits={self.bits}, block_size={self.block_size})"
