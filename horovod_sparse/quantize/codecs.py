"""The quantizers' value codes: bfloat16, QSGD, TernGrad, sign, scaled sign, 1-bit SGD.

Each is a :class:`~horovod_sparse.quantize.codec.ValueCodec` (see its contract):
``encode(values, seed)`` -> exactly ``nbytes(count)`` uint8, ``decode(data, count)``
-> float32, pure. Layouts are "header, then bit-packed codes" (headers are float32
little-endian; codes packed by :mod:`.bitpack`, LSB first).

Written once over :mod:`horovod_sparse.ops`: the same code runs on numpy and on
torch tensors on any device, and gives bitwise the same bytes and floats on both,
because every step is elementwise IEEE float32 or integer arithmetic, the random
numbers are the counter-based stream of :mod:`.uniform`, and the headers' sums are
fixed-order trees (:mod:`.sums`). Each encode is a few in-place passes over the values
into reused scratch buffers (:mod:`.scratch`); each decode writes its floats once or
twice.

TensorFlow tensors (the step as TensorFlow ops on the gradients' device) take the same
path: each kernel below that writes into a buffer has a TensorFlow branch that returns a
new tensor (the same elementwise float32 and integer operations, so the same bits), and
``_encode``/``_decode`` use what the kernels return; on numpy and torch that is the buffer
they wrote. Stochastic codes draw the same counter-based numbers on the device.

Nothing here raises on data (encoders run inside collective exchanges, where a raise
on one rank would leave the others waiting); what non-finite input gives is stated per
codec: in short, a NaN or inf never silently turns into a finite value except where a
1-bit sign code cannot carry it (SignCodec).

References: QSGD, Alistarh et al., NeurIPS'17; TernGrad, Wen et al., NeurIPS'17;
signSGD / Signum, Bernstein et al., ICML'18; EF-signSGD, Karimireddy et al., ICML'19;
1-bit SGD, Seide et al., Interspeech'14.
"""
import functools
import math
import sys

import numpy as np

from horovod_sparse.checks import check_int
from horovod_sparse.ops import indices, kernels, namespace, views
from horovod_sparse.ops.cpu import quantize as fused

from .bitpack import code_dtype, pack_into, packed_nbytes, padded_count, unpack_into
from .codec import ValueCodec, as_bytes, as_values
from .lookup import decode_small_codes
from .sums import tree_sum_rows
from .uniform import random_int16, stream_keys


# --------------------------------------------------------------- small helpers
def _quiet(method):
    """Run ``method`` with numpy's floating-point warnings off: overflow, NaN and 0/0 are
    part of the codes' documented behaviour (torch never warns)."""
    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with np.errstate(all="ignore"):
            return method(*args, **kwargs)
    return wrapped


def _scalar(value, like):
    """A Python number as a float32 divisor that keeps float32 arithmetic, and numpy's quotient,
    in ``like``'s library: numpy would compute an integer array times a Python float in float64;
    torch on CUDA divides by a Python number as a product with its reciprocal (1 ulp off the
    quotient), by a tensor on the device as a true division."""
    if namespace.is_torch(like):
        torch = sys.modules["torch"]
        return float(value) if namespace.host_shortcut_allowed(like) else torch.full((), float(value), device=like.device)
    return np.float32(value)


def _tf():
    return sys.modules["tensorflow"]


_EMPTY = np.zeros(0, np.float32)


def _or_empty(buffer):
    """A kernel's optional float32 output: the buffer, or an empty array (not wanted)."""
    return _EMPTY if buffer is None else buffer


def _window(buffer, start, stop=None):
    """``buffer[start:stop]``, or None where there is no buffer (TensorFlow: new tensors)."""
    return None if buffer is None or buffer is True else buffer[start:stop]


def _joined(out, *parts):
    """What was written: ``out`` (numpy, torch: the parts are its pieces, already in place),
    or the parts concatenated (TensorFlow, ``out`` None)."""
    if out is not None and out is not True:
        return out
    parts = [p for p in parts if p is not None]
    return parts[0] if len(parts) == 1 else _tf().concat(parts, 0)


def _write_floats(out, floats):
    """Write the float32 1-D ``floats`` as the first 4 * len bytes of the uint8 ``out``; returns
    those bytes (TensorFlow: a new uint8 tensor)."""
    if namespace.is_tensorflow(floats):
        return _tf().reshape(_tf().bitcast(floats, _tf().uint8), [-1])
    k = floats.shape[0]
    if namespace.is_torch(floats):
        if floats.stride(0) != 1:  # a column of a matrix (a tree's sums)
            import torch
            floats = torch.empty(k, dtype=floats.dtype, device=floats.device).copy_(floats)
    else:
        floats = np.ascontiguousarray(floats)
    out[:4 * k] = floats.view(namespace.dtype_of(floats, "uint8"))
    return out[:4 * k]


def _read_floats(data, k, scratch):
    """The first ``k`` float32 of the uint8 ``data`` (copied to an aligned scratch buffer)."""
    if namespace.is_tensorflow(data):
        return _tf().bitcast(_tf().reshape(data[:4 * k], [k, 4]), _tf().float32)
    aligned = scratch.get("header", 4 * k, "uint8", data)
    aligned[...] = data[:4 * k]
    return aligned.view(namespace.dtype_of(aligned, "float32"))


def _aligned_view(data, dtype_name, scratch, name):
    """``data`` (uint8) viewed as ``dtype_name``; via an aligned scratch copy if ``data``
    starts at an offset torch cannot view (numpy views any offset)."""
    itemsize = np.dtype(dtype_name).itemsize
    if namespace.is_torch(data) and (data.storage_offset() % itemsize or data.shape[0] == 0):
        copy = scratch.get(name, data.shape[0], "uint8", data)
        copy[...] = data
        data = copy
    return data.view(namespace.dtype_of(data, dtype_name))


def _negative_bits(x, scratch):
    """uint8 0/1 per value, 1 where x < 0 (so sign(0) = sign(-0) = sign(NaN) = +1), in a
    zero-padded buffer of ``padded_count`` values (the 1-bit packer's input; TensorFlow: a
    new tensor of ``count``)."""
    if namespace.is_tensorflow(x):
        return _tf().cast(x < 0, _tf().uint8)
    count = x.shape[0]
    mask = scratch.get("negative", padded_count(count), "bool", x)
    kernels.less_into(x, 0, mask[:count])
    mask[count:] = False
    return mask.view(namespace.dtype_of(mask, "uint8"))


def _pair(when_zero, when_one, like):
    """float32 [when_zero, when_one] in ``like``'s library and device (0-d arrays or numpy
    scalars in, their bits kept): the values of a 1-bit code (:mod:`.lookup`)."""
    if namespace.is_tensorflow(like):
        return _tf().stack([_tf().cast(when_zero, _tf().float32), _tf().cast(when_one, _tf().float32)])
    if namespace.is_torch(when_zero) and namespace.is_torch(when_one):
        pair = namespace.empty(2, "float32", like)
        pair[0], pair[1] = when_zero, when_one
        return pair
    # numpy's (a CUDA tensor takes no numpy scalar): built on the host, moved with its bits
    pair = np.array([when_zero, when_one], np.float32)
    return sys.modules["torch"].from_numpy(pair).to(like.device) if namespace.is_torch(like) else pair


def _signs(magnitude, like):
    """float32 [magnitude, -magnitude], the second the first with its sign bit flipped
    (exact for every float, NaN included)."""
    pair = _pair(magnitude, magnitude, like)
    if namespace.is_tensorflow(pair):
        tf = _tf()
        flipped = tf.bitwise.bitwise_xor(tf.bitcast(pair, tf.int32), tf.constant([0, -(1 << 31)], tf.int32))
        return tf.bitcast(flipped, tf.float32)
    views.int_view(pair)[1:] ^= -(1 << 31)
    return pair


def _sqrt(values):
    """float32 square roots rounded to nearest, as IEEE defines them. torch's CPU kernel
    can be 1 ulp off, so each root moves to the neighbour whose rounding interval holds
    the exact root: the float64 squares of float32 midpoints are exact. (Small arrays.)"""
    if namespace.is_tensorflow(values):  # the same correction (tf.sqrt may be approximate too)
        tf = _tf()
        root = tf.sqrt(values)
        down = tf.math.nextafter(root, tf.zeros_like(root))
        up = tf.math.nextafter(root, tf.fill(tf.shape(root), tf.constant(math.inf, tf.float32)))
        wide = tf.cast(values, tf.float64)
        low_mid = (tf.cast(root, tf.float64) + tf.cast(down, tf.float64)) / 2
        high_mid = (tf.cast(root, tf.float64) + tf.cast(up, tf.float64)) / 2
        root = tf.where(wide < low_mid * low_mid, down, root)
        return tf.where(wide > high_mid * high_mid, up, root)
    lib, xp = namespace.backend(values), namespace.namespace(values)
    root = lib.sqrt(values)
    down = lib.nextafter(root, xp.zeros_like(root))
    up = lib.nextafter(root, xp.full_like(root, math.inf))
    wide, as_wide = xp.astype(values, xp.float64), (lambda v: xp.astype(v, xp.float64))
    low_mid = (as_wide(root) + as_wide(down)) / 2
    high_mid = (as_wide(root) + as_wide(up)) / 2
    root = xp.where(wide < low_mid * low_mid, down, root)
    return xp.where(wide > high_mid * high_mid, up, root)


# ----------------------------------------------------------------------- bf16
class BF16Codec(ValueCodec):
    """bfloat16: the top 16 bits of the float32, rounded to nearest, ties to even.

    Layout: ``count`` little-endian int16 (2 bytes per value, no header).
    Error: |decode(x) - x| <= 2**-8 * |x| for normal values (8 significant bits,
    half an ulp); float32 subnormals keep bfloat16's (coarser) subnormal grid.
    Non-finite: +-inf stay +-inf; every NaN becomes the quiet NaN 0x7FC0 (whatever its
    sign and payload); finite values of magnitude >= (2 - 2**-8) * 2**127 round to
    +-inf, as IEEE rounding does.

    Encode: torch's own cast (numpy: the rounding in int32 arithmetic), then NaNs are
    made canonical when the sum of the values says there may be one. Decode: the
    int16 codes shifted into the top half of int32 words.
    """

    name = "bf16"
    _QUIET_NAN = 0x7FC0

    def nbytes(self, count):
        return 2 * int(count)

    @_quiet
    def encode(self, values, seed=0, out=None, decoded=None):
        x = as_values(values)
        if namespace.is_tensorflow(x):
            return self._encode(x, seed, None, None)[0]
        out = self._code_buffer(out, x.shape[0], x)
        in_place = not namespace.is_torch(out) or (out.storage_offset() % 2 == 0 and out.shape[0] > 0)
        codes = (out.view(namespace.dtype_of(out, "int16")) if in_place
                 else self.scratch.get("codes", x.shape[0], "int16", x))
        kernels.bfloat16_bits(x, codes)
        xp = namespace.namespace(x)
        if not namespace.host_shortcut_allowed(x):  # a device: a masked fill, no read-back of the sum
            codes.masked_fill_(xp.isnan(x), self._QUIET_NAN)
        elif not math.isfinite(float(xp.sum(x))):  # one fast reduction; NaN only if it says so
            nan = xp.isnan(x)
            if bool(xp.any(nan)):
                codes[nan] = self._QUIET_NAN
        if not in_place:
            out[...] = codes.view(namespace.dtype_of(codes, "uint8"))
        if decoded is not None:
            self._values(codes, decoded)
        return out

    def _encode(self, x, seed, out, decoded):
        """TensorFlow's encode (numpy, torch: :meth:`encode`): the same rounding by
        :func:`~horovod_sparse.ops.kernels.bfloat16_bits`, every NaN made the quiet NaN."""
        tf = _tf()
        codes = kernels.bfloat16_bits(x, None)
        codes = tf.where(tf.math.is_nan(x), tf.constant(self._QUIET_NAN, tf.int16), codes)
        return tf.reshape(tf.bitcast(codes, tf.uint8), [-1]), None if decoded is None else self._values(codes, None)

    @_quiet
    def decode(self, data, count, out=None):
        data = as_bytes(data)[:2 * count]
        if namespace.is_tensorflow(data):
            return self._values(_tf().bitcast(_tf().reshape(data, [count, 2]), _tf().int16), None)
        out = self._value_buffer(out, count, data)
        return self._values(_aligned_view(data, "int16", self.scratch, "codes"), out)

    @staticmethod
    def _values(codes, out):
        """float32 whose top 16 bits are the codes, low 16 bits zero (TensorFlow: new)."""
        if namespace.is_tensorflow(codes):
            tf = _tf()
            return tf.bitcast(tf.bitwise.left_shift(tf.cast(codes, tf.int32), 16), tf.float32)
        as_int = out.view(namespace.dtype_of(out, "int32"))
        as_int[...] = codes
        as_int <<= 16
        return out


# --------------------------------------------------- stochastic levels: QSGD, TernGrad
class _StochasticLevels(ValueCodec):
    """Shared by QSGD and TernGrad: per bucket a float32 scale, per value an unbiased
    stochastic level in {-s, .., s}, carried as the offset code ``level + s``.

    For a value x of a bucket with scale S (its header; ``levels`` = s):

    1. ``inv = s / S`` in float32 (S = 0, S not finite, or s / S overflowing: the bucket
       is *broken* and all its codes are s, i.e. level 0);
    2. ``code = trunc(x * inv + (h + 65536 s + 32768.5) * 2**-16)`` in float32 (each
       product and sum rounded), with h the value's int16 of :mod:`.uniform`: for
       s < 128 the second term is s + u exactly, u uniform in (0, 1), so
       ``code - s = floor(x * inv + u)``, a stochastic rounding of x * inv: unbiased;
    3. decode: ``(code - s) * (S / s)`` in float32.

    x * inv lies in [-s, s] up to float32 rounding, so codes lie in [0, 2s]; for
    s > 31 that rounding could reach 2s + 1, so codes are clipped to [0, 2s] there.
    Layout: the B bucket scales (float32), then the codes, ``bits = 1 +
    ceil(log2(s + 1))`` each, bit-packed.

    Step 2 is :meth:`_scaled` and :meth:`_offset_levels`: int4's absmax code (:mod:`.absmax`)
    keeps steps 1 and 3 and this layout, and rounds x / S * s to the nearest level instead.
    """

    stochastic = True

    def __init__(self, levels):
        self.levels = levels
        self.bits = 1 + math.ceil(math.log2(self.levels + 1))

    def _bucket(self, count):
        raise NotImplementedError

    def _buckets(self, count):
        raise NotImplementedError

    def _scales(self, x, bucket, scratch):
        """float32 per-bucket scales S (a scratch view), the codec's own statistic."""
        raise NotImplementedError

    def nbytes(self, count):
        return 4 * self._buckets(count) + packed_nbytes(count, self.bits)

    def _encode(self, x, seed, out, decoded):
        count, scratch, s = x.shape[0], self.scratch, self.levels
        if count == 0:
            if namespace.is_tensorflow(x):
                return namespace.zeros(self.nbytes(0), "uint8", x), namespace.zeros(0, "float32", x)
            if self._buckets(0):
                out[...] = 0
            return out, decoded
        bucket = self._bucket(count)
        scales = self._scales(x, bucket, scratch)
        head = _write_floats(out, scales)
        # 1. inv = s / S per bucket; broken buckets get inv = 0 (and level 0 below)
        inv, broken = _inverse(scales, s, scratch)
        steps = self._steps(scales, scratch) if decoded is not None else None
        lookup = self._lookup_values(steps, count, x) if decoded is not None else None
        # 2. y = x * inv + (h + 65536 s + 32768.5) * 2**-16, codes = trunc(y); block by
        # block, so that the temporaries stay in cache
        packed, streams, floats = _window(out, 4 * scales.shape[0]), [], []
        for start, stop, first in _blocks_of(x, count, bucket, scales.shape[0]):
            y = self._scaled(x[start:stop], inv[first:], scales[first:], bucket,
                             scratch.get("levels", stop - start, "float32", x))
            y = self._offset_levels(y, seed, start, scratch, x)
            if broken is not None:  # NaN * 0 in a broken bucket: level 0 there
                y = _broken_rows(y, broken[first:], bucket, s)
            if s > 31:
                y = _clipped(y, 0, 2 * s)
            codes = self._codes(y, stop - start, scratch)
            if decoded is not None and lookup is None:
                floats.append(self._values(codes[:stop - start], steps[first:], bucket,
                                           _window(decoded, start, stop)))
            streams.append(pack_into(codes, self.bits, stop - start,
                                     _window(packed, start * self.bits // 8), scratch))
        packed = _joined(packed, *streams)
        if lookup is not None:
            floats = [decode_small_codes(packed, self.bits, count, lookup, decoded)]
        return _joined(out, head, packed), None if decoded is None else _joined(decoded, *floats)

    #: the compiled levels (:func:`~horovod_sparse.ops.cpu.quantize.levels_encode`) on CPU buffers
    fused_cpu = True

    def _encode_fused(self, x, seed, out, decoded, residual):
        """:meth:`_encode` in one compiled pass (:func:`~horovod_sparse.ops.cpu.quantize.levels_encode`;
        TernGrad's scale first, one read): the same bytes and floats."""
        count, scratch = x.shape[0], self.scratch
        if count == 0 or not out.flags.c_contiguous:  # the kernel stores 8 bytes at a time
            return False
        buckets, bucket = self._buckets(count), self._bucket(count)
        scales = scratch.get("norms", buckets, "float32", x)
        norms_here = self._fused_scales(x, scales)
        k1, k2 = (np.uint64(k & 0xFFFFFFFF) for k in stream_keys(seed))
        # the norm of the only bucket sums its blocks' trees (_blocks: multiples of 8); buckets of
        # several are whole within a block
        block = 8 * max(1, BLOCK // 8) if buckets == 1 else bucket
        row = scratch.get("squares", min(bucket, block, count), "float32", x)
        codes = scratch.get("fused_codes", fused._CHUNK, "uint8" if self.bits < 8 else "int32", x)
        fused.levels_encode(x, scales, norms_here, bucket, block, self.levels, self.bits, k1, k2, 0,
                            out[4 * buckets:], _or_empty(decoded), _or_empty(residual), row, codes,
                            not self.stochastic)
        _write_floats(out, scales)
        return True

    def _fused_scales(self, x, scales):
        """Fill ``scales`` before the encode pass, or return True: the pass computes them."""
        raise NotImplementedError

    def _scaled(self, x, inv, scales, bucket, out):
        """Step 2's x * inv per bucket, into ``out`` (TensorFlow: new)."""
        return _per_bucket("multiply", x, inv, bucket, out)

    def _offset_levels(self, y, seed, start, scratch, like):
        """Step 2 before the truncation: y = x * inv (values start .. of the stream) plus
        s + u, in place (TensorFlow: new). A deterministic code overrides the rounding."""
        return _plus(y, _noise(y.shape[0], seed, self.levels, scratch, like, start))

    def _decode_fused(self, data, count, out):
        if count == 0 or not data.flags.c_contiguous:  # the kernel loads 8 bytes at a time
            return False
        scales = _read_floats(data, self._buckets(count), self.scratch)
        fused.levels_decode(data[4 * scales.shape[0]:], count, scales, self._bucket(count), self.levels,
                            self.bits, out)
        return True

    def _codes(self, y, count, scratch):
        """trunc(y) as the codes (numpy, torch: a zero-padded scratch buffer of :func:`code_dtype`
        and ``padded_count``; TensorFlow: new int32)."""
        if namespace.is_tensorflow(y):
            return _tf().cast(y, _tf().int32)
        codes = scratch.get("codes", padded_count(count), code_dtype(self.bits), y)
        codes[count:] = 0
        if self.bits <= 8:
            kernels.cast_into(codes[:count], y)
        else:  # via int32: codes up to 65535 do not fit int16's positive range
            wide = scratch.get("wide", count, "int32", y)
            codes[:count] = kernels.cast_into(wide, y)
        return codes

    def _decode(self, data, count, out):
        if count == 0:
            return namespace.zeros(0, "float32", data) if namespace.is_tensorflow(data) else out
        scratch = self.scratch
        scales = _read_floats(data, self._buckets(count), scratch)
        packed = data[4 * scales.shape[0]:]
        steps, bucket = self._steps(scales, scratch), self._bucket(count)
        lookup = self._lookup_values(steps, count, steps)
        if lookup is not None:
            return decode_small_codes(packed, self.bits, count, lookup, out)
        floats = []
        for start, stop, first in _blocks_of(data, count, bucket, scales.shape[0]):
            codes = scratch.get("codes", padded_count(stop - start), code_dtype(self.bits), data)
            codes = unpack_into(packed[start * self.bits // 8:], self.bits, stop - start, codes, scratch)
            floats.append(self._values(codes, steps[first:], bucket, _window(out, start, stop)))
        return _joined(out, *floats)

    def _steps(self, scales, scratch):
        """S / s per bucket: the value of one level."""
        if namespace.is_tensorflow(scales):
            return scales / np.float32(self.levels)
        steps = scratch.get("steps", scales.shape[0], "float32", scales)
        return namespace.backend(scales).divide(scales, _scalar(self.levels, scales), out=steps)

    def _lookup_values(self, steps, count, like):
        """With one bucket and codes of <= 2 bits (TernGrad): the float32 (code - s) * (S / s)
        of every code, computed as :meth:`_values` computes them, for a one-pass decode by
        table (:mod:`.lookup`); else None."""
        if self.bits > 2 or self._buckets(count) != 1:
            return None
        if namespace.is_tensorflow(like):
            values = _tf().cast(namespace.arange(1 << self.bits, like), _tf().float32) - np.float32(self.levels)
        else:
            values = kernels.cast_into(self.scratch.get("lookup", 1 << self.bits, "float32", like),
                                       namespace.arange(1 << self.bits, like))
            values -= self.levels
        return _per_bucket("multiply", values, steps, 1 << self.bits, values)

    def _values(self, codes, steps, bucket, out):
        """3. out = (code - s) * (S / s) (codes of whole buckets, or of part of the only bucket);
        returns ``out`` (TensorFlow: new floats from the int32 codes, ``out`` unused)."""
        if namespace.is_tensorflow(codes):
            values = _tf().cast(codes, _tf().float32) - np.float32(self.levels)
            return _per_bucket("multiply", values, steps, bucket, None)
        s = self.levels
        if self.bits == 16:  # int16 holds codes >= 32768 as negative numbers
            wide = self.scratch.get("wide", codes.shape[0], "int32", out)
            wide[...] = codes
            wide &= 0xFFFF
            codes = wide
        kernels.cast_into(out, codes)
        out -= s
        _per_bucket("multiply", out, steps, bucket, out)
        return out


#: values per block of the stochastic codes' encode and decode (1 MB of float32)
BLOCK = 1 << 18


def _blocks(count, bucket, buckets):
    """(start, stop, first bucket) of consecutive blocks of about :data:`BLOCK` values, each
    a multiple of 8 values and, with several buckets, of whole buckets."""
    unit = 8 if buckets == 1 else bucket * 8 // math.gcd(bucket, 8)
    size = unit * max(1, BLOCK // unit)
    for start in range(0, count, size):
        yield start, min(start + size, count), 0 if buckets == 1 else start // bucket


def bucket_rows(x, bucket, out, prepare, reduce_rows, combine):
    """``out[b]`` = ``reduce_rows`` of bucket b's values after ``prepare`` (numpy or torch), block
    by block (:func:`_blocks`, whole buckets each): ``prepare(values)`` returns a scratch array of
    them transformed, ``reduce_rows(matrix)`` one value per row; a bucket longer than a block (the
    only one) gets ``combine(out, part)`` (in place) of its later blocks' parts."""
    count = x.shape[0]
    for start, stop, first in _blocks(count, bucket, out.shape[0]):
        values = prepare(x[start:stop])
        full = (stop - start) // bucket
        if full:
            out[first:first + full] = reduce_rows(values[:full * bucket].reshape(full, bucket))
        if full * bucket < stop - start:
            part = reduce_rows(values[full * bucket:].reshape(1, -1))
            if start and out.shape[0] == 1:
                combine(out, part)
            else:
                out[first + full:] = part
    return out


def _blocks_of(x, count, bucket, buckets):
    """:func:`_blocks`; one block on TensorFlow (new tensors: no temporaries to keep in cache;
    the counter-based noise and the per-bucket arithmetic do not depend on the blocks)."""
    return [(0, count, 0)] if namespace.is_tensorflow(x) else _blocks(count, bucket, buckets)


def _inverse(scales, s, scratch):
    """(inv, broken): inv = s / S per bucket, 0 where the bucket is broken (S zero or not
    finite, or s / S overflowing); broken the bool mask of those buckets, None if none."""
    if namespace.is_tensorflow(scales):
        tf = _tf()
        inv = np.float32(s) / scales
        good = tf.math.is_finite(inv) & tf.math.is_finite(scales)
        broken = None if bool(tf.reduce_all(good)) else ~good
        return (inv if broken is None else tf.where(broken, tf.zeros_like(inv), inv)), broken
    lib, xp = namespace.backend(scales), namespace.namespace(scales)
    inv = scratch.get("inverse", scales.shape[0], "float32", scales)
    inv[...] = s
    lib.divide(inv, scales, out=inv)
    good = xp.isfinite(inv) & xp.isfinite(scales)
    if not namespace.host_shortcut_allowed(scales):  # a device: no read-back of whether any is broken
        broken = ~good
        inv.masked_fill_(broken, 0)
        return inv, broken
    broken = None if bool(xp.all(good)) else ~good
    if broken is not None:
        inv[broken] = 0
    return inv, broken


def _noise(count, seed, s, scratch, like, start):
    """float32 (h + 65536 s + 32768.5) * 2**-16 of values start .. start + count - 1."""
    h = random_int16(count, seed, scratch, like, start)
    if namespace.is_tensorflow(like):  # the constant rounded to float32 first, as numpy does
        return (_tf().cast(h, _tf().float32) + np.float32(65536.0 * s + 32768.5)) * np.float32(2.0 ** -16)
    noise = scratch.get("noise", count, "float32", like)
    kernels.cast_into(noise, h)
    noise += 65536.0 * s + 32768.5
    noise *= 2.0 ** -16
    return noise


def _plus(y, z):
    """y += z (TensorFlow: y + z); returns the sum."""
    if namespace.is_tensorflow(y):
        return y + z
    y += z
    return y


def _clipped(y, low, high):
    """y clipped to [low, high] in place (TensorFlow: new); returns it."""
    if namespace.is_tensorflow(y):
        return _tf().clip_by_value(y, np.float32(low), np.float32(high))
    namespace.backend(y).clip(y, low, high, out=y)
    return y


def _per_bucket(op, x, per_bucket, bucket, out):
    """out = op(x, per_bucket[bucket of each value]) for consecutive buckets of ``bucket``
    values starting at x[0] (the last one may be shorter), as one broadcast over full
    buckets plus the tail. ``op`` names the library's function ("multiply"); returns ``out``
    (TensorFlow: a new tensor, each value with its bucket's factor)."""
    count = x.shape[0]
    if namespace.is_tensorflow(x):
        tf = _tf()
        # (one bucket longer than x: repeated count times, not bucket_size, up to 2**31 - 1)
        factors = tf.repeat(per_bucket[:-(-count // bucket)], min(bucket, count))[:count]
        return getattr(tf.math, op)(x, factors)
    op = getattr(namespace.backend(x), op)
    full = count // bucket
    if full:
        op(x[:full * bucket].reshape(full, bucket), per_bucket[:full, None],
           out=out[:full * bucket].reshape(full, bucket))
    if full * bucket < count:
        op(x[full * bucket:], per_bucket[full], out=out[full * bucket:count])
    return out


def _broken_rows(y, broken, bucket, level):
    """y = level (code s, level 0) in the buckets flagged ``broken``; returns y (TensorFlow: new)."""
    count = y.shape[0]
    if namespace.is_tensorflow(y):
        tf = _tf()
        flagged = tf.repeat(broken[:-(-count // bucket)], min(bucket, count))[:count]
        return tf.where(flagged, tf.fill(tf.shape(y), np.float32(level)), y)
    full = count // bucket
    if not namespace.host_shortcut_allowed(y):  # a device: masked fills, no read-back of the mask
        if full:
            y[:full * bucket].view(full, bucket).masked_fill_(broken[:full, None], level)
        if full * bucket < count:
            y[full * bucket:].masked_fill_(broken[full], level)
        return y
    if full:
        y[:full * bucket].reshape(full, bucket)[broken[:full]] = level
    if full * bucket < count and bool(broken[full]):
        y[full * bucket:] = level
    return y


class _FixedBuckets(_StochasticLevels):
    """Levels over consecutive buckets of ``bucket_size`` values (the last one may be shorter)."""

    def _bucket(self, count):
        return self.bucket_size

    def _buckets(self, count):
        return -(-int(count) // self.bucket_size)


class QSGDCodec(_FixedBuckets):
    """QSGD (Alistarh et al., NeurIPS'17): per bucket the L2 norm and stochastic levels.

    Parameters
    ----------
    levels : int in [1, 2**15 - 1]
        Number of quantization levels s (QSGD's s); 16 by default. Each value is
        ``sign * norm * l / s`` with l in {0, .., s}.
    bucket_size : int in [1, 2**31 - 1]
        Values per bucket d (each bucket has its own norm); 512 by default.

    The scale of a bucket is its L2 norm, ``sqrt`` of the fixed-order float32 tree sum
    (:mod:`.sums`) of the squares; then the stochastic levels of
    :class:`_StochasticLevels` with s = ``levels``: |x| * s / norm is rounded up with
    probability equal to its fractional part (up to 2**-17), the sign kept; E[decode] =
    x up to float32 rounding; Var <= min(d/s**2, sqrt(d)/s) * norm**2 per bucket, and
    per value Var <= (norm / s)**2 / 4.

    Layout (``nbytes(count) = 4 * ceil(count / bucket_size) + ceil(count * bits / 8)``
    with ``bits = 1 + ceil(log2(levels + 1))``): one float32 norm per bucket, in bucket
    order; then per value the code ``level + s`` (level in [-s, s], signed), bits each.

    Non-finite: a bucket holding an inf or NaN, or whose squares overflow float32
    (|x| >= ~1.8e19), has a non-finite norm, gets all levels 0 and decodes as NaN
    entirely (0 * inf); other buckets are unaffected. A bucket whose norm is 0 or below
    s * 2**-128 decodes as 0.
    """

    name = "qsgd"

    def __init__(self, levels=16, bucket_size=512):
        super().__init__(check_int("levels", levels, 1, 2 ** 15 - 1))
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2 ** 31 - 1)

    def _scales(self, x, bucket, scratch):
        count = x.shape[0]
        if namespace.is_tensorflow(x):  # the same rows summed by the same tree, block by block
            tf, rows = _tf(), {}
            for start, stop, first in _blocks(count, bucket, self._buckets(count)):
                squares, full = x[start:stop] * x[start:stop], (stop - start) // bucket
                if full:
                    rows[first] = tree_sum_rows(tf.reshape(squares[:full * bucket], [full, bucket]))
                if full * bucket < stop - start:
                    part = tree_sum_rows(tf.reshape(squares[full * bucket:], [1, -1]))
                    # one bucket longer than a block (buckets == 1) goes on in the next block:
                    # its blocks' sums are added in order, as below
                    rows[first + full] = rows[first + full] + part if first + full in rows else part
            return _sqrt(tf.concat([rows[k] for k in sorted(rows)], 0))
        lib = namespace.backend(x)
        norms = scratch.get("norms", self._buckets(count), "float32", x)

        def squares(block):
            return lib.multiply(block, block, out=scratch.get("squares", block.shape[0], "float32", x))

        def add(total, part):  # one bucket longer than a block: its blocks' sums added in order
            total += part

        bucket_rows(x, bucket, norms, squares, tree_sum_rows, add)
        norms[...] = _sqrt(norms)
        return norms

    def _fused_scales(self, x, scales):
        return True  # each bucket's norm, as the pass reaches it

    def __repr__(self):
        return f"QSGDCodec(levels={self.levels}, bucket_size={self.bucket_size})"


class TernGradCodec(_StochasticLevels):
    """TernGrad (Wen et al., NeurIPS'17): per-vector scale and stochastic ternary values.

    S = max |x| over the whole vector (float32 header); each value becomes
    t in {-1, 0, +1} with P(t = sign(x)) = |x| / S (up to 2**-17), else 0; decode = S * t.
    These are the stochastic levels of :class:`_StochasticLevels` with s = 1 and one
    bucket. Unbiased: E[decode] = x; per value Var = |x| * (S - |x|) <= S**2 / 4.
    (TernGrad's gradient clipping and per-layer scales are not applied: the scale
    is per encoded vector, i.e. per fused buffer or per chunk of it.)

    Layout (``nbytes(count) = 4 + ceil(count / 4)``): float32 S, then 2-bit codes
    t + 1 (0: -1, 1: 0, 2: +1), bit-packed.

    Non-finite: an inf or NaN anywhere makes S non-finite; then every code is "0" and
    the whole vector decodes as NaN (S * 0). An empty vector has S = 0; so has a vector
    of zeros, which decodes as zeros.
    """

    name = "terngrad"

    def __init__(self):
        super().__init__(1)

    def _bucket(self, count):
        return max(int(count), 1)

    def _buckets(self, count):
        return 1

    def _scales(self, x, bucket, scratch):
        if namespace.is_tensorflow(x):  # max |x| = max(|min|, |max|); a NaN anywhere gives NaN
            tf = _tf()
            scale = tf.reduce_max(tf.abs(x), keepdims=True)
            return tf.where(tf.reduce_any(tf.math.is_nan(x)), tf.constant([math.nan], tf.float32), scale)
        xp = namespace.namespace(x)
        low, high = (namespace.backend(x).aminmax(x) if namespace.is_torch(x) else (np.min(x), np.max(x)))
        scale = scratch.get("scale", 1, "float32", x)
        scale[...] = xp.maximum(xp.abs(low), xp.abs(high))  # abs: no -0 from -min
        return scale

    def _fused_scales(self, x, scales):
        fused.max_magnitude(x, scales)
        return False


# ----------------------------------------------------------------- sign codes
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
    #: float32 header words before the bits
    header_floats = 0
    _ONE = np.float32(1)

    def nbytes(self, count):
        return 4 * self.header_floats + packed_nbytes(count, 1)

    def _encode(self, x, seed, out, decoded):
        count = x.shape[0]
        bits = _negative_bits(x, self.scratch)
        header = self._header(x, bits, count)
        head = None if header is None else _write_floats(out, header)
        stream = pack_into(bits, 1, count, _window(out, 4 * self.header_floats), self.scratch)
        if decoded is not None:  # from the code's own bytes: decode's floats, one pass
            decoded = decode_small_codes(stream, 1, count, self._values(header, x), decoded)
        return _joined(out, head, stream), decoded

    def _decode(self, data, count, out):
        k = self.header_floats
        header = _read_floats(data, k, self.scratch) if k else None
        return decode_small_codes(data[4 * k:], 1, count, self._values(header, data if out is None else out), out)

    def _header(self, x, bits, count):
        """The header floats (float32 array of ``header_floats``), or None."""
        return None

    fused_cpu = True

    def _encode_fused(self, x, seed, out, decoded, residual):
        """:meth:`_encode` by compiled kernels: the header's sums in one read
        (:func:`~horovod_sparse.ops.cpu.quantize.tree_sums`), then bits, decoded floats and
        residual in one pass (:func:`~horovod_sparse.ops.cpu.quantize.sign_encode`)."""
        if not x.flags.c_contiguous:  # the kernel loads 64 values at a time
            return False
        header = self._fused_header(x, x.shape[0])
        if header is not None:
            _write_floats(out, header)
        fused.sign_encode(x, out[4 * self.header_floats:], self._values(header, x), _or_empty(decoded),
                          _or_empty(residual))
        return True

    def _fused_header(self, x, count):
        """:meth:`_header`'s floats, by the kernels (the same bits)."""
        return None

    def _decode_fused(self, data, count, out):
        k = self.header_floats
        header = _read_floats(data, k, self.scratch) if k else None
        fused.one_bit_decode(data[4 * k:], count, self._values(header, out), out)
        return True

    sums_codes_fused = True

    def _decode_sum_fused(self, first, second, count, out):
        k = self.header_floats
        values = [self._values(_read_floats(code, k, self.scratch) if k else None, out) for code in (first, second)]
        fused.one_bit_sum_of_two(first[4 * k:], values[0], second[4 * k:], values[1], count, out)
        return True

    def vote_of_two(self, first, second, out):
        """The code of the majority vote of two codes (uint8, same count): negative only where
        both are (elsewhere the sum of the signs is 0 or 2, and sign(0) = +1), so the bits
        ANDed. The compressed allreduce's P = 2 vote, without decoding either code. (TensorFlow:
        a new tensor, ``out`` unused.)"""
        if namespace.is_tensorflow(first):
            return _tf().bitwise.bitwise_and(first, second)
        return namespace.backend(out).bitwise_and(first, second, out=out)

    def _values(self, header, like):
        """float32 [value of bit 0, value of bit 1] given the header."""
        return _signs(self._ONE, like)


class ScaledSignCodec(SignCodec):
    """EF-signSGD's scaled sign (Karimireddy et al., ICML'19): mean |x| times sign(x).

    decode = scale * sign(x) with scale = ||x||_1 / count (float32: the fixed-order tree
    sum of :mod:`.sums` divided by count; 0 for an empty vector) and sign(0) = +1.
    Biased; meant to be used with error feedback.

    Layout (``nbytes(count) = 4 + ceil(count / 8)``): float32 scale, then one bit
    per value (1 for negative), bit-packed.

    Non-finite: an inf or NaN makes the scale inf or NaN, so every value decodes
    as +-inf or NaN.
    """

    name = "scaled_sign"
    aggregate = "sum"
    header_floats = 1

    def _header(self, x, bits, count):
        if namespace.is_tensorflow(x):
            tf = _tf()
            magnitudes = tf.abs(x) if count else tf.zeros([1], tf.float32)
            return tree_sum_rows(tf.reshape(magnitudes, [1, -1])) / _scalar(max(count, 1), x)
        magnitudes = self.scratch.get("magnitudes", max(count, 1), "float32", x)
        if count:
            namespace.backend(x).abs(x, out=magnitudes)
        else:
            magnitudes[...] = 0
        scale = tree_sum_rows(magnitudes.reshape(1, -1))
        scale /= _scalar(max(count, 1), x)
        return scale

    def _fused_header(self, x, count):
        scale = self.scratch.get("means", 1, "float32", x)
        scale[0] = fused.tree_sums(x, 0, self.scratch)[0][0] if count else 0
        scale /= np.float32(max(count, 1))
        return scale

    def _values(self, header, like):
        return _signs(header[0], like)


class OneBitCodec(SignCodec):
    """1-bit SGD (Seide et al., Interspeech'14): one bit per value and two reconstruction values.

    pos = mean of the entries with x >= 0 (and NaN entries), neg = mean of the
    entries with x < 0 (0 for an empty side), both float32: the fixed-order tree sums
    (:mod:`.sums`) of min(x, 0) and of max(x, 0), divided by the sides' counts;
    decode = neg where x < 0, else pos (exactly those float32). Minimises the squared
    error for the given split; biased, meant to be used with error feedback.

    Layout (``nbytes(count) = 8 + ceil(count / 8)``): float32 pos, float32 neg, then
    one bit per value (1 for x < 0), bit-packed.

    Non-finite: an inf makes its side's mean inf; a NaN makes both means NaN; so no
    value of a vector holding a NaN decodes as finite.
    """

    name = "onebit"
    aggregate = "sum"
    header_floats = 2

    def _header(self, x, bits, count):
        device = namespace.is_torch(x) and not namespace.host_shortcut_allowed(x)
        # the count of negatives: on a device a 0-d tensor there (no read-back), else an int
        negatives = (bits[:count] != 0).sum() if device else indices.count_nonzero(bits[:count])
        if namespace.is_tensorflow(x):  # numpy's clip: -0 becomes +0 on both sides, NaN stays
            tf = _tf()
            zero = tf.zeros_like(x)
            sides = (tf.stack([tf.where(x <= 0, zero, x), tf.where(x >= 0, zero, x)]) if count
                     else tf.zeros([2, 1], tf.float32))
            sums = tree_sum_rows(sides)                             # [sum of max(x, 0), of min(x, 0)]
            return sums / tf.constant([max(count - negatives, 1), max(negatives, 1)], tf.float32)
        lib, scratch = namespace.backend(x), self.scratch
        sides = scratch.get("sides", 2 * max(count, 1), "float32", x).reshape(2, -1)
        if count:
            lib.clip(x, 0, None, out=sides[0])
            lib.clip(x, None, 0, out=sides[1])
        else:
            sides[...] = 0
        means = scratch.get("means", 2, "float32", x)
        means[...] = tree_sum_rows(sides)                           # [sum of max(x, 0), of min(x, 0)]
        if device:  # float32 divisors on the device: a true division, as _scalar's
            means[0] /= (count - negatives).clamp_min(1).to(means.dtype)
            means[1] /= negatives.clamp_min(1).to(means.dtype)
            return means
        means[0] /= _scalar(max(count - negatives, 1), x)
        means[1] /= _scalar(max(negatives, 1), x)
        return means

    def _fused_header(self, x, count):
        means = self.scratch.get("means", 2, "float32", x)
        means[...], negatives = fused.tree_sums(x, 1, self.scratch) if count else (0, 0)
        means[0] /= np.float32(max(count - negatives, 1))
        means[1] /= np.float32(max(negatives, 1))
        return means

    def _values(self, header, like):
        return _pair(header[0], header[1], like)
