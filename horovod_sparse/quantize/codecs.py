"""The quantizers' value codes: bfloat16, QSGD, TernGrad, sign, scaled sign, 1-bit SGD.

Each is a :class:`~horovod_sparse.quantize.codec.ValueCodec` (see its contract):
``encode(values, seed)`` -> exactly ``nbytes(count)`` uint8, ``decode(data, count)``
-> float32, pure. Layouts are "header, then bit-packed codes" (headers are float32
little-endian; codes packed by :mod:`.bitpack`, LSB first). Stochastic codes draw
only from ``np.random.default_rng(seed)``; deterministic ones ignore ``seed``.

Nothing here raises on data (encoders run inside collective exchanges, where a raise
on one rank would leave the others waiting); what non-finite input gives is stated per
codec: in short, a NaN or inf never silently turns into a finite value except where a
1-bit sign code cannot carry it (SignCodec).

References: QSGD, Alistarh et al., NeurIPS'17; TernGrad, Wen et al., NeurIPS'17;
signSGD / Signum, Bernstein et al., ICML'18; EF-signSGD, Karimireddy et al., ICML'19;
1-bit SGD, Seide et al., Interspeech'14.
"""
import math

import numpy as np

from horovod_sparse.checks import check_int

from .bitpack import pack, packed_nbytes, unpack
from .codec import VALUE_DTYPE, ValueCodec

_F32 = np.dtype("<f4")


def _as_values(values):
    return np.ascontiguousarray(np.asarray(values).ravel(), dtype=VALUE_DTYPE)


def _floats_to_bytes(*floats):
    return np.array(floats, dtype=_F32).view(np.uint8)


def _bytes_to_floats(data, count, offset=0):
    return np.frombuffer(np.ascontiguousarray(data[offset:offset + 4 * count], dtype=np.uint8).tobytes(),
                         _F32, count=count).astype(VALUE_DTYPE)


def _sign_bits(values):
    """1 where the value is negative (x < 0), else 0: sign(0) = sign(-0) = sign(NaN) = +1."""
    return (values < 0).astype(np.uint8)


class BF16Codec(ValueCodec):
    """bfloat16: the top 16 bits of the float32, rounded to nearest, ties to even.

    Layout: ``count`` little-endian uint16 (2 bytes per value, no header).
    Error: |decode(x) - x| <= 2**-8 * |x| for normal values (8 significant bits,
    half an ulp); float32 subnormals keep bfloat16's (coarser) subnormal grid.
    Non-finite: +-inf stay +-inf; NaN stays NaN (the quiet bit is forced, so a
    payload in the low bits cannot round into inf); finite values of magnitude
    >= (2 - 2**-8) * 2**127 round to +-inf, as IEEE rounding does.
    """

    name = "bf16"

    def encode(self, values, seed=0):
        bits = _as_values(values).view(np.uint32)
        # Round to nearest even on the 16 dropped bits: add 0x7FFF plus the kept LSB.
        rounded = ((bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))
                   >> np.uint32(16)).astype(np.uint16)
        nan = np.isnan(bits.view(VALUE_DTYPE))
        if nan.any():
            rounded[nan] = ((bits[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
        return rounded.astype("<u2").view(np.uint8)

    def decode(self, data, count):
        half = np.frombuffer(np.ascontiguousarray(data[:2 * count], dtype=np.uint8).tobytes(), "<u2",
                             count=count)
        return (half.astype(np.uint32) << np.uint32(16)).view(VALUE_DTYPE)

    def nbytes(self, count):
        return 2 * int(count)


class QSGDCodec(ValueCodec):
    """QSGD (Alistarh et al., NeurIPS'17): per bucket, the L2 norm and stochastic levels.

    Parameters
    ----------
    levels : int in [1, 2**15 - 1]
        Number of quantization levels s (QSGD's s); 16 by default. Each value is
        ``sign * norm * l / s`` with l in {0, .., s}.
    bucket_size : int in [1, 2**31 - 1]
        Values per bucket d (each bucket has its own norm); 512 by default.

    For a value x of a bucket with norm ||v||_2 (stored as float32, ``norm``), let
    r = |x| * (s / norm); l = floor(r) + 1 with probability r - floor(r), else floor(r);
    decode = sign(x) * norm * l / s. E[decode] = x (unbiased, up to float32 rounding
    of the stored norm and decoded value); Var <= min(d/s**2, sqrt(d)/s) * norm**2 per
    bucket, and per value Var <= (norm / s)**2 / 4.

    Layout (``nbytes(count) = 4 * ceil(count / bucket_size) + ceil(count * bits / 8)``
    with ``bits = 1 + ceil(log2(levels + 1))``):

    * header: one float32 norm per bucket, in bucket order;
    * codes: per value ``l << 1 | negative`` (sign bit is the LSB, set for x < 0),
      ``bits`` bits each, bit-packed.

    Non-finite: a bucket holding an inf or NaN has a non-finite norm, gets all levels
    0, and decodes as NaN entirely (inf * 0); so does a bucket whose norm overflows
    float32 (values near the float32 maximum). Other buckets are unaffected.
    """

    name = "qsgd"
    stochastic = True

    def __init__(self, levels=16, bucket_size=512):
        self.levels = check_int("levels", levels, 1, 2 ** 15 - 1)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2 ** 31 - 1)
        self.bits = 1 + math.ceil(math.log2(self.levels + 1))

    def _buckets(self, count):
        return -(-int(count) // self.bucket_size)

    def nbytes(self, count):
        return 4 * self._buckets(count) + packed_nbytes(count, self.bits)

    def encode(self, values, seed=0):
        x = _as_values(values)
        count = x.size
        if count == 0:
            return np.zeros(0, np.uint8)
        starts = np.arange(0, count, self.bucket_size)
        x64 = x.astype(np.float64)
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(np.add.reduceat(x64 * x64, starts)).astype(_F32)
        norms64 = norms.astype(np.float64)
        good = np.isfinite(norms64) & (norms64 > 0)
        # Per bucket s / norm (0 for zero or non-finite norms: all levels 0 there).
        inverse = np.zeros(norms.size)
        inverse[good] = self.levels / norms64[good]
        ratio = np.abs(x64)
        with np.errstate(invalid="ignore"):
            ratio *= np.repeat(inverse, self.bucket_size)[:count]
        if not good.all():
            ratio[~np.isfinite(ratio)] = 0  # inf * 0 in a non-finite bucket
        level = np.floor(ratio)
        ratio -= level  # the probability of rounding up
        level += np.random.default_rng(seed).random(count) < ratio
        # The float32 norm may round below |x| by an ulp: never exceed the top level.
        np.minimum(level, self.levels, out=level)
        codes = (level.astype(np.uint16) << np.uint16(1)) | _sign_bits(x)
        return np.concatenate([norms.view(np.uint8), pack(codes, self.bits)])

    def decode(self, data, count):
        count = int(count)
        if count == 0:
            return np.zeros(0, VALUE_DTYPE)
        buckets = self._buckets(count)
        norms = _bytes_to_floats(data, buckets).astype(np.float64)
        codes = unpack(np.asarray(data)[4 * buckets:], self.bits, count).astype(np.int64)
        level = (codes >> 1).astype(np.float64)
        sign = 1.0 - 2.0 * (codes & 1)
        norm_each = np.repeat(norms, self.bucket_size)[:count]
        with np.errstate(invalid="ignore", over="ignore"):
            return (sign * norm_each * level / self.levels).astype(VALUE_DTYPE)

    def __repr__(self):
        return f"QSGDCodec(levels={self.levels}, bucket_size={self.bucket_size})"


class TernGradCodec(ValueCodec):
    """TernGrad (Wen et al., NeurIPS'17): per-tensor scale and stochastic ternary values.

    s = max |x| over the whole vector (float32 header); each value becomes
    t in {-1, 0, +1} with P(t = sign(x)) = |x| / s, else 0; decode = s * t.
    Unbiased: E[decode] = x; per value Var = |x| * (s - |x|) <= s**2 / 4.
    (TernGrad's gradient clipping and per-layer scales are not applied: the scale
    is per encoded vector, i.e. per fused buffer or per chunk of it.)

    Layout (``nbytes(count) = 4 + ceil(count / 4)``): float32 s, then 2-bit codes
    (0: 0, 1: +1, 2: -1), bit-packed.

    Non-finite: an inf or NaN anywhere makes s non-finite; then every code is 0 and
    the whole vector decodes as NaN (s * 0). An empty vector has s = 0.
    """

    name = "terngrad"
    stochastic = True
    bits = 2

    def nbytes(self, count):
        return 4 + packed_nbytes(count, self.bits)

    def encode(self, values, seed=0):
        x = _as_values(values)
        with np.errstate(invalid="ignore"):
            scale = np.float32(np.max(np.abs(x))) if x.size else np.float32(0)
        u = np.random.default_rng(seed).random(x.size)
        if np.isfinite(scale) and scale > 0:
            keep = u < np.abs(x.astype(np.float64)) / float(scale)
        else:
            keep = np.zeros(x.size, bool)
        codes = keep.astype(np.uint8) * (1 + _sign_bits(x))
        return np.concatenate([_floats_to_bytes(scale), pack(codes, self.bits)])

    def decode(self, data, count):
        scale = _bytes_to_floats(data, 1)[0]
        codes = unpack(np.asarray(data)[4:], self.bits, count)
        ternary = np.zeros(int(count), VALUE_DTYPE)
        ternary[codes == 1] = 1
        ternary[codes == 2] = -1
        with np.errstate(invalid="ignore"):
            return scale * ternary


class SignCodec(ValueCodec):
    """signSGD (Bernstein et al., ICML'18): one bit per value, decoded as +-1.

    sign(0) = sign(-0) = +1; NaN encodes as +1, +-inf as +-1 (one bit cannot
    carry a NaN: a NaN gradient is silently voted as +1). Contributions combine by
    majority vote (``aggregate = "majority"``): the sum over P ranks is
    P * sign(sum of signs).

    Layout (``nbytes(count) = ceil(count / 8)``): bit 1 for negative, bit-packed.
    """

    name = "sign"
    aggregate = "majority"

    def nbytes(self, count):
        return packed_nbytes(count, 1)

    def encode(self, values, seed=0):
        return pack(_sign_bits(_as_values(values)), 1)

    def decode(self, data, count):
        bits = unpack(data, 1, count)
        return (1 - 2 * bits.astype(np.int8)).astype(VALUE_DTYPE)


class ScaledSignCodec(ValueCodec):
    """EF-signSGD's scaled sign (Karimireddy et al., ICML'19): mean |x| times sign(x).

    decode = scale * sign(x) with scale = ||x||_1 / count (float32, 0 for an empty
    vector) and sign(0) = +1. Biased; meant to be used with error feedback.

    Layout (``nbytes(count) = 4 + ceil(count / 8)``): float32 scale, then one bit
    per value (1 for negative), bit-packed.

    Non-finite: an inf or NaN makes the scale inf or NaN, so every value decodes
    as +-inf or NaN.
    """

    name = "scaled_sign"

    def nbytes(self, count):
        return 4 + packed_nbytes(count, 1)

    def encode(self, values, seed=0):
        x = _as_values(values)
        with np.errstate(invalid="ignore", over="ignore"):
            scale = np.float32(np.mean(np.abs(x.astype(np.float64)))) if x.size else np.float32(0)
        return np.concatenate([_floats_to_bytes(scale), pack(_sign_bits(x), 1)])

    def decode(self, data, count):
        scale = _bytes_to_floats(data, 1)[0]
        bits = unpack(np.asarray(data)[4:], 1, count)
        with np.errstate(invalid="ignore"):
            return np.where(bits == 1, -scale, scale).astype(VALUE_DTYPE)


class OneBitCodec(ValueCodec):
    """1-bit SGD (Seide et al., Interspeech'14): one bit per value and two reconstruction values.

    pos = mean of the entries with x >= 0 (and NaN entries), neg = mean of the
    entries with x < 0 (0 for an empty side), both float32; decode = neg where x < 0,
    else pos. Minimises the squared error for the given split; biased, meant to be
    used with error feedback.

    Layout (``nbytes(count) = 8 + ceil(count / 8)``): float32 pos, float32 neg, then
    one bit per value (1 for x < 0), bit-packed.

    Non-finite: a NaN (on the non-negative side) or inf makes that side's mean
    non-finite, so every value of that side decodes as NaN or inf.
    """

    name = "onebit"

    def nbytes(self, count):
        return 8 + packed_nbytes(count, 1)

    def encode(self, values, seed=0):
        x = _as_values(values)
        negative = x < 0
        x64 = x.astype(np.float64)
        with np.errstate(invalid="ignore", over="ignore"):
            n_neg = int(negative.sum())
            n_pos = x.size - n_neg
            neg = np.float32(x64[negative].sum() / n_neg) if n_neg else np.float32(0)
            pos = np.float32(x64[~negative].sum() / n_pos) if n_pos else np.float32(0)
        return np.concatenate([_floats_to_bytes(pos, neg), pack(negative.astype(np.uint8), 1)])

    def decode(self, data, count):
        pos, neg = _bytes_to_floats(data, 2)
        bits = unpack(np.asarray(data)[8:], 1, count)
        return np.where(bits == 1, neg, pos).astype(VALUE_DTYPE)
