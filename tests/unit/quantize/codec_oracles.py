"""Independent oracles of the quantizers' codes: their documented definitions written out
plainly with numpy (uint64 integer math, explicit loops, np.float32 scalars), sharing no
code with horovod_sparse.quantize. Each returns (header floats, integer codes) for
``encode`` and float32 values for the round trip; ``packed`` lays codes out as the
documented bit stream (code i at stream bits [i*bits, (i+1)*bits), LSB first).
"""
import math

import numpy as np

F32 = np.float32
MASK32 = (1 << 32) - 1
MASK64 = (1 << 64) - 1


# ------------------------------------------------------------- random stream
def splitmix64(z):
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def random_halves(count, seed):
    """h_i of horovod_sparse.quantize.uniform's docstring, as Python ints in [-32768, 32767]."""
    z = splitmix64(seed % (1 << 64))
    k1, k2 = z & MASK32, z >> 32
    j = np.arange((count + 1) // 2, dtype=np.uint64)
    x = (j + np.uint64(k1)) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & np.uint64(MASK32)
    x ^= np.uint64(k2)
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x846CA68B)) & np.uint64(MASK32)
    x ^= x >> np.uint64(16)
    halves = np.stack([x & np.uint64(0xFFFF), x >> np.uint64(16)], axis=1).ravel()[:count].astype(np.int64)
    return np.where(halves >= 32768, halves - 65536, halves)


# ---------------------------------------------------------------- tree sums
def tree_sum(values):
    """The documented fixed-order float32 sum: while w > 1: h = w // 2;
    v[j] += v[j + w - h] for j < h; w -= h."""
    v = [F32(a) for a in values]
    w = len(v)
    while w > 1:
        h = w // 2
        for j in range(h):
            v[j] = F32(v[j] + v[j + w - h])
        w -= h
    return v[0]


# ------------------------------------------------------------------- codes
def packed(codes, bits):
    codes = np.asarray(codes, dtype=np.uint64)
    matrix = (codes[:, None] >> np.arange(bits, dtype=np.uint64)) & np.uint64(1)
    return np.packbits(matrix.astype(np.uint8).ravel(), bitorder="little")


def floats_bytes(*floats):
    return np.array(floats, dtype="<f4").view(np.uint8)


def stochastic_levels(x, scales, bucket, levels, seed):
    """QSGD/TernGrad offset codes trunc(x * inv + (h + 65536 s + 32768.5) * 2**-16)."""
    s = levels
    h = random_halves(x.size, seed)
    codes = np.empty(x.size, np.int64)
    for i in range(x.size):
        scale = scales[i // bucket]
        with np.errstate(all="ignore"):
            inv = F32(F32(s) / scale)
        broken = not (np.isfinite(inv) and np.isfinite(scale))
        if broken:
            codes[i] = s
            continue
        noise = F32(F32(F32(h[i]) + F32(65536.0 * s + 32768.5)) * F32(2.0 ** -16))
        y = F32(F32(x[i] * inv) + noise)
        if s > 31:
            y = min(max(y, F32(0)), F32(2 * s))
        codes[i] = math.trunc(float(y))
    return codes


def level_values(codes, scales, bucket, levels):
    with np.errstate(all="ignore"):
        return np.array([F32(F32(c - levels) * F32(scales[i // bucket] / F32(levels)))
                         for i, c in enumerate(codes)], dtype=F32)


def qsgd(x, levels, bucket, seed):
    """(bytes, decoded) of QSGD as documented."""
    with np.errstate(all="ignore"):
        norms = np.array([np.sqrt(tree_sum([F32(a * a) for a in x[i:i + bucket]]))
                          for i in range(0, x.size, bucket)], dtype=F32)
    codes = stochastic_levels(x, norms, bucket, levels, seed)
    bits = 1 + math.ceil(math.log2(levels + 1))
    return (np.concatenate([floats_bytes(*norms), packed(codes, bits)]),
            level_values(codes, norms, bucket, levels))


def terngrad(x, seed):
    scale = F32(np.max(np.abs(x))) if x.size else F32(0)
    codes = stochastic_levels(x, [scale], max(x.size, 1), 1, seed)
    return (np.concatenate([floats_bytes(scale), packed(codes, 2)]),
            level_values(codes, [scale], max(x.size, 1), 1))


def sign(x):
    negative = (x < 0).astype(np.int64)
    return packed(negative, 1), np.where(negative == 1, F32(-1), F32(1)).astype(F32)


def scaled_sign(x):
    scale = F32(tree_sum(np.abs(x)) / F32(x.size)) if x.size else F32(0)
    negative = (x < 0).astype(np.int64)
    return (np.concatenate([floats_bytes(scale), packed(negative, 1)]),
            np.where(negative == 1, -scale, scale).astype(F32))


def onebit(x):
    negative = x < 0
    with np.errstate(all="ignore"):
        pos_sum = tree_sum([max(a, F32(0)) if not np.isnan(a) else a for a in x]) if x.size else F32(0)
        neg_sum = tree_sum([min(a, F32(0)) if not np.isnan(a) else a for a in x]) if x.size else F32(0)
        pos = F32(pos_sum / F32(max(int((~negative).sum()), 1)))
        neg = F32(neg_sum / F32(max(int(negative.sum()), 1)))
    return (np.concatenate([floats_bytes(pos, neg), packed(negative.astype(np.int64), 1)]),
            np.where(negative, neg, pos).astype(F32))


def onebit_buckets(x, bucket):
    """(bytes, decoded) of 1-bit SGD's two means per bucket as documented: a value is negative at
    or below -2**-126 (zeros, denormals, NaN are not); per bucket the tree sums of its values on
    each side (x at or beyond +-2**-126, else +0; a NaN on both), divided by the side's count (at
    least 1), a mean below 2**-126 in magnitude +0; all the means first, two per bucket, then
    the bits."""
    tiny = 2.0 ** -126
    means, decoded = [], []

    def flushed(mean):
        return F32(0) if abs(float(mean)) < tiny else mean

    with np.errstate(all="ignore"):
        for start in range(0, x.size, bucket):
            part = [F32(a) for a in x[start:start + bucket]]
            negative = [float(a) <= -tiny for a in part]
            pos = tree_sum([F32(0) if float(a) < tiny else a for a in part]) / F32(max(len(part) - sum(negative), 1))
            neg = tree_sum([F32(0) if float(a) > -tiny else a for a in part]) / F32(max(sum(negative), 1))
            pos, neg = flushed(F32(pos)), flushed(F32(neg))
            means += [pos, neg]
            decoded += [neg if n else pos for n in negative]
    bits = packed([int(float(a) <= -tiny) for a in x], 1)
    return np.concatenate([floats_bytes(*means), bits]).astype(np.uint8), np.array(decoded, dtype=F32)


def int4(x, bits, bucket):
    """(bytes, decoded) of int4's absmax code as documented: S = max |x| of the bucket (NaN if it
    holds one; 0 below L * 2**-126), level = round(F32(F32(x / S) * L)) with Python's round (ties
    to even), code level + L; L for every value of a bucket where S is 0 or not finite."""
    L = 2 ** (bits - 1) - 1
    scales, codes = [], []
    with np.errstate(all="ignore"):
        for start in range(0, x.size, bucket):
            part = [F32(a) for a in x[start:start + bucket]]
            scale = F32(math.nan) if any(math.isnan(a) for a in part) else F32(max(abs(float(a)) for a in part))
            scale = F32(0) if scale < L * 2.0 ** -126 else scale
            broken = scale == 0 or not math.isfinite(scale)
            codes += [L if broken else round(float(F32(F32(a / scale) * F32(L)))) + L for a in part]
            scales.append(scale)
    decoded = level_values(codes, scales, bucket, L) if codes else np.zeros(0, F32)
    return np.concatenate([floats_bytes(*scales), packed(codes, bits)]).astype(np.uint8), decoded
