"""Bit packing of unsigned codes of 1..16 bits each into a byte string, numpy or torch.

Layout: one continuous little-endian bit stream. Code ``i`` occupies stream bits
``[i * bits, (i + 1) * bits)``, least significant bit first, and stream bit ``b`` is
bit ``b % 8`` (LSB = 0) of byte ``b // 8``. The packed length is exactly
``ceil(count * bits / 8)`` bytes; the unused high bits of the last byte are zero.

How (vectorised in-place integer operations, the same in numpy and torch): 8
consecutive codes always fill exactly ``bits`` whole bytes. The codes sit one per byte
(bits <= 8) or one per int16 (bits > 8) in a buffer whose length is a multiple of 8,
read as int64 words; SWAR steps then squeeze the gaps out of every word:

* bits <= 8, 8 codes per word: pairs of byte slots become 16-bit slots holding
  ``c0 | c1 << bits``, pairs of those 32-bit slots, then one 8*bits-bit field: each
  step ``w = (w & low) | ((w & high) >> gap)`` with masks selecting alternate slots;
  bits = 1 is one multiplication instead (every byte is 0 or 1: ``w * 0x0102040810204080``
  gathers byte k's bit into bit 56 + k, no carries since all partial products differ);
* bits > 8, 4 codes per word: two steps give 4*bits-bit fields, and two words make
  the 8*bits bits of a group: ``lo = w0 | w1 << 4*bits``, ``hi = w1 >> (64 - 4*bits)``.

The first ``bits`` bytes of every (lo[, hi]) group are the stream: copied out as bytes,
or, for bits = 1, 2, 4, by one truncating copy of the words into uint8/int16/int32 (no
byte gather). Unpacking runs the steps backwards, from words whose bytes past the
group's are masked off. Codes never reach bit 63 of a word, so arithmetic and logical
right shifts agree. The work is ~12 in-place passes over count bytes.

:func:`pack_into`/:func:`unpack_into` work in the caller's buffers (numpy or torch, any
device); :func:`pack`/:func:`unpack` are the allocating numpy interface.

TensorFlow tensors (immutable) are packed by :func:`pack_into` into a new tensor, and unpacked
by :func:`unpack_into` into new int32 codes, with the same layout: 8 codes of <= 8 bits are
one int64 word per group (``code k << k * bits``, disjoint bits, below bit 56), cut into its
``bits`` bytes; codes of 9..16 bits go through their bits, one per element.
"""
import sys

import numpy as np

from horovod_sparse.ops import namespace, views

from .scratch import Scratch


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an integer in [1, 16], got {bits!r}")
    return int(bits)


def packed_nbytes(count, bits):
    """Bytes of ``count`` packed codes of ``bits`` bits: ceil(count * bits / 8)."""
    return (int(count) * _check_bits(bits) + 7) // 8


def code_dtype(bits):
    """The dtype name holding one code: "uint8" for bits <= 8, else "int16"."""
    return "uint8" if _check_bits(bits) <= 8 else "int16"


def padded_count(count):
    """Length of a code buffer for ``count`` codes: a multiple of 8."""
    return -(-int(count) // 8) * 8


def _mask(width, *positions):
    """int64 with ``width`` one-bits at each of ``positions``."""
    value = sum(((1 << width) - 1) << p for p in positions)
    return value - (1 << 64) if value >= 1 << 63 else value


def _steps(bits):
    """SWAR steps (low mask, high mask, gap) packing slots of 8 or 16 bits (module docstring)."""
    steps, field, slot = [], bits, 8 if bits <= 8 else 16
    while slot < 64:
        starts = range(0, 64, 2 * slot)
        steps.append((_mask(field, *starts), _mask(field, *(p + slot for p in starts)), slot - field))
        field, slot = 2 * field, 2 * slot
    return steps


_GATHER_ONE_BIT = 0x0102040810204080
_SPREAD_ONE_BIT = 0x0101010101010101
_BIT_OF_BYTE = _mask(1, *range(0, 64, 9))       # 0x8040201008040201: bit k of byte k
_LOW7 = 0x7F7F7F7F7F7F7F7F
_ONES = 0x0101010101010101


def pack_into(codes, bits, count, out, scratch):
    """Pack the first ``count`` codes of ``codes`` into ``out[:packed_nbytes(count, bits)]``.

    codes : 1-D buffer of dtype :func:`code_dtype` (uint8 or int16) and length
        ``padded_count(count)``, codes in [0, 2**bits), zeros after ``count``;
        overwritten (it is the working space). TensorFlow: any integer tensor of at least
        ``count`` codes in [0, 2**bits).
    out : 1-D uint8 buffer, same library/device. Returns ``out[:nbytes]`` (TensorFlow: a
        new uint8 tensor of ``nbytes``; ``out`` may be None).
    """
    bits = _check_bits(bits)
    nbytes = packed_nbytes(count, bits)
    if namespace.is_tensorflow(codes):  # a new tensor; ``out`` and ``scratch`` unused
        return _pack_tensorflow(codes, bits, int(count), nbytes)
    if count == 0:
        return out[:0]
    if bits in (8, 16):  # already the stream
        out[:nbytes] = codes[:count].view(namespace.dtype_of(codes, "uint8"))[:nbytes]
        return out[:nbytes]
    if bits == 1 and views.numpy_view(codes) is not None:  # numpy's packbits: one vector pass
        views.numpy_view(out)[:nbytes] = np.packbits(views.numpy_view(codes)[:count], bitorder="little")
        return out[:nbytes]
    lib = namespace.backend(codes)
    words = codes.view(namespace.dtype_of(codes, "int64"))
    temp = scratch.get("pack_temp", words.shape[0], "int64", codes)
    if bits == 1:
        lib.multiply(words, _GATHER_ONE_BIT, out=words)
        words >>= 56
        words &= 0xFF
        out[:nbytes] = words[:nbytes]
        return out[:nbytes]
    for low, high, gap in _steps(bits):
        lib.bitwise_and(words, high, out=temp)
        temp >>= gap
        words &= low
        words |= temp
    if bits > 8:  # two words of 4 codes (4 * bits bits each) make one group of 8 codes
        pairs = words.reshape(-1, 2)
        first, second = pairs[:, 0], pairs[:, 1]
        spill = temp[:pairs.shape[0]]
        lib.bitwise_and(second, -1, out=spill)
        spill >>= 64 - 4 * bits
        second <<= 4 * bits
        first |= second
        second[...] = spill
        stream = pairs.view(namespace.dtype_of(codes, "uint8")).reshape(-1, 16)[:, :bits]
    else:
        stream = words.view(namespace.dtype_of(codes, "uint8")).reshape(-1, 8)[:, :bits]
    whole = count // 8
    whole_words = _word_view(out[:whole * bits], bits)
    if whole_words is not None:  # 2 or 4 bytes per group: a truncating copy, no byte gather
        whole_words[...] = words[:whole]
    else:
        _copy_rows(out[:whole * bits].reshape(whole, bits), stream[:whole])
    if nbytes > whole * bits:
        out[whole * bits:nbytes] = stream[whole, :nbytes - whole * bits]
    return out[:nbytes]


def unpack_into(data, bits, count, codes, scratch):
    """Inverse of :func:`pack_into`: the first ``count`` codes of ``data`` into ``codes``.

    data : 1-D uint8 (numpy or torch) of at least ``packed_nbytes(count, bits)`` bytes.
    codes : 1-D buffer of :func:`code_dtype` and length ``padded_count(count)``, same
        library/device. Returns ``codes[:count]``; codes after ``count`` are garbage.
        TensorFlow: returns new int32 codes (``count``); ``codes`` may be None.
    """
    bits = _check_bits(bits)
    nbytes = packed_nbytes(count, bits)
    if namespace.is_tensorflow(data):  # new int32 codes; ``codes`` and ``scratch`` unused
        return _unpack_tensorflow(data, bits, int(count), nbytes)
    if count == 0:
        return codes[:0]
    as_bytes = codes.view(namespace.dtype_of(codes, "uint8"))
    if bits in (8, 16):
        as_bytes[:nbytes] = data[:nbytes]
        return codes[:count]
    lib = namespace.backend(codes)
    words = codes.view(namespace.dtype_of(codes, "int64"))
    temp = scratch.get("pack_temp", words.shape[0], "int64", codes)
    if bits == 1:
        groups = words.shape[0]
        packed = temp[:groups]
        packed[:nbytes] = data[:nbytes]  # one byte of 8 bits per word
        packed[nbytes:] = 0
        lib.multiply(packed, _SPREAD_ONE_BIT, out=words)   # byte k = the whole byte
        words &= _BIT_OF_BYTE                              # byte k = its bit k (0 or 2**k)
        words += _LOW7                                     # bit 7 of byte k set iff nonzero
        words >>= 7
        words &= _ONES
        return codes[:count]
    width = 16 if bits > 8 else 8
    stream = as_bytes.reshape(-1, width)
    whole = count // 8
    whole_words = _word_view(data[:whole * bits], bits)
    if whole_words is not None:  # 2 or 4 bytes per group: one widening copy, masked below
        words[:whole] = whole_words
    else:
        _copy_rows(stream[:whole, :bits], data[:whole * bits].reshape(whole, bits))
    if stream.shape[0] > whole:
        stream[whole, :] = 0
        stream[whole, :nbytes - whole * bits] = data[whole * bits:nbytes]
    # the bytes after the first ``bits`` of each group are stale: masked off below
    if bits > 8:  # one group of 8 codes -> two words of 4 codes
        pairs = words.reshape(-1, 2)
        first, second = pairs[:, 0], pairs[:, 1]
        second &= _mask(8 * bits - 64, 0)
        spill = temp[:pairs.shape[0]]
        lib.bitwise_and(first, -1, out=spill)
        spill >>= 4 * bits
        spill &= _mask(64 - 4 * bits, 0)
        second <<= 64 - 4 * bits
        second |= spill
        first &= _mask(4 * bits, 0)
    else:
        words &= _mask(8 * bits, 0)
    for low, high, gap in reversed(_steps(bits)):
        lib.bitwise_and(words, low, out=temp)
        words <<= gap
        words &= high
        words |= temp
    return codes[:count]


def _pack_tensorflow(codes, bits, count, nbytes):
    """:func:`pack_into` of a TensorFlow integer tensor: a new uint8 tensor of ``nbytes``."""
    tf = sys.modules["tensorflow"]
    codes = tf.cast(codes[:count], tf.int64)
    if bits == 8:
        return tf.cast(codes, tf.uint8)
    codes = tf.pad(codes, [[0, padded_count(count) - count]])
    if bits < 8:  # a group of 8 codes: one word, its low ``bits`` bytes the stream
        groups = tf.reshape(codes, [-1, 8])
        word = tf.reduce_sum(tf.bitwise.left_shift(groups, tf.constant([k * bits for k in range(8)], tf.int64)), 1)
        shifts = tf.constant([8 * j for j in range(bits)], tf.int64)
        stream = tf.bitwise.bitwise_and(tf.bitwise.right_shift(word[:, None], shifts), 0xFF)
    else:  # the codes' bits, LSB first, eight to a byte
        one_bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(codes[:, None], tf.range(bits, dtype=tf.int64)), 1)
        stream = tf.reduce_sum(tf.bitwise.left_shift(tf.reshape(one_bits, [-1, 8]), tf.range(8, dtype=tf.int64)), 1)
    return tf.cast(tf.reshape(stream, [-1])[:nbytes], tf.uint8)


def _unpack_tensorflow(data, bits, count, nbytes):
    """:func:`unpack_into` of a TensorFlow uint8 tensor: the ``count`` codes, new int32."""
    tf = sys.modules["tensorflow"]
    data = tf.cast(data[:nbytes], tf.int64)
    if bits == 8:
        return tf.cast(data, tf.int32)
    if bits < 8:
        groups = -(-count // 8)
        stream = tf.reshape(tf.pad(data, [[0, groups * bits - nbytes]]), [groups, bits])
        word = tf.reduce_sum(tf.bitwise.left_shift(stream, tf.constant([8 * j for j in range(bits)], tf.int64)), 1)
        shifts = tf.constant([k * bits for k in range(8)], tf.int64)
        codes = tf.bitwise.bitwise_and(tf.bitwise.right_shift(word[:, None], shifts), (1 << bits) - 1)
    else:
        one_bits = tf.bitwise.bitwise_and(tf.bitwise.right_shift(data[:, None], tf.range(8, dtype=tf.int64)), 1)
        one_bits = tf.reshape(tf.reshape(one_bits, [-1])[:count * bits], [count, bits])
        codes = tf.reduce_sum(tf.bitwise.left_shift(one_bits, tf.range(bits, dtype=tf.int64)), 1)
    return tf.cast(tf.reshape(codes, [-1])[:count], tf.int32)


def _copy_rows(dst, src):
    """``dst[...] = src`` for 2-D uint8 arrays of short rows (a group's ``bits`` bytes).
    numpy copies such an array row by row, a loop per 6 bytes; one strided copy per column
    of the widest integer dividing the row is ~5x faster. (torch: one kernel anyway.)"""
    if namespace.is_torch(dst):
        dst[...] = src
        return
    width = dst.shape[1]
    unit = 4 if width % 4 == 0 else 2 if width % 2 == 0 else 1
    dst, src = dst.view(f"<i{unit}"), src.view(f"<i{unit}")
    for k in range(width // unit):
        dst[:, k] = src[:, k]


def _word_view(groups, bits):
    """The uint8 ``groups`` (whole groups of 8 codes, ``bits`` bytes each) as one int16 or int32
    per group when bits is 2 or 4 (and torch can view it at its offset), else None."""
    if bits not in (2, 4) or (namespace.is_torch(groups) and groups.storage_offset() % bits):
        return None
    return groups.view(namespace.dtype_of(groups, "int16" if bits == 2 else "int32"))


# ------------------------------------------------------------ numpy interface
def pack(codes, bits):
    """Pack the unsigned integer ``codes`` (any shape, flattened) into a new uint8 array.

    codes : integers in [0, 2**bits); only their low ``bits`` bits are kept.
    bits : code width in bits, 1..16.
    Returns a new uint8 numpy array of ``ceil(codes.size * bits / 8)`` bytes.
    """
    bits = _check_bits(bits)
    codes = np.asarray(codes).ravel()
    count = codes.size
    buffer = np.zeros(padded_count(count), code_dtype(bits))
    buffer[:count] = codes & ((1 << bits) - 1)
    return pack_into(buffer, bits, count, np.empty(packed_nbytes(count, bits), np.uint8), Scratch()).copy()


def unpack(data, bits, count):
    """Inverse of :func:`pack`: the first ``count`` codes of ``data``.

    data : uint8 array of at least ``ceil(count * bits / 8)`` bytes (extra bytes ignored).
    Returns a new numpy array of ``count`` codes, uint8 for bits <= 8, uint16 otherwise.
    """
    bits = _check_bits(bits)
    count = int(count)
    data = np.asarray(data, dtype=np.uint8).ravel()
    nbytes = packed_nbytes(count, bits)
    if data.size < nbytes:
        raise ValueError(f"data holds {data.size} bytes, {nbytes} needed for {count} codes "
                         f"of {bits} bits")
    codes = np.empty(padded_count(count), code_dtype(bits))
    out = unpack_into(data, bits, count, codes, Scratch())
    return out.astype(np.uint8 if bits <= 8 else np.uint16)
