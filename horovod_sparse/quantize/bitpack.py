"""Bit packing of unsigned codes of 1..16 bits each into a byte string.

Layout: one continuous little-endian bit stream. Code ``i`` occupies stream bits
``[i * bits, (i + 1) * bits)``, least significant bit first, and stream bit ``b`` is
bit ``b % 8`` (LSB = 0) of byte ``b // 8``. The packed length is exactly
``ceil(count * bits / 8)`` bytes; the unused high bits of the last byte are zero.

How (vectorised, no Python loop over values): 8 consecutive codes always fill exactly
``bits`` whole bytes, so each group of 8 codes is assembled into one 128-bit word
(two little-endian uint64) with 8 shift-or steps, and the first ``bits`` bytes of
every word are the stream. Memory is about 16 bytes per 8 codes, so 25M codes take
~50 MB of temporaries and well under a second.
"""
import numpy as np

_WORD = np.dtype("<u8")


def _check_bits(bits):
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 16:
        raise ValueError(f"bits must be an integer in [1, 16], got {bits!r}")
    return int(bits)


def packed_nbytes(count, bits):
    """Bytes of ``count`` packed codes of ``bits`` bits: ceil(count * bits / 8)."""
    return (int(count) * _check_bits(bits) + 7) // 8


def pack(codes, bits):
    """Pack the unsigned integer ``codes`` (any shape, flattened) into a uint8 array.

    codes : integers in [0, 2**bits); only their low ``bits`` bits are kept.
    bits : code width in bits, 1..16.
    Returns a new uint8 array of ``ceil(codes.size * bits / 8)`` bytes.
    """
    bits = _check_bits(bits)
    codes = np.asarray(codes).ravel()
    count = codes.size
    nbytes = (count * bits + 7) // 8
    if count == 0:
        return np.zeros(0, np.uint8)
    if 8 % bits == 0:
        return _pack_within_bytes(codes, bits)
    groups = -(-count // 8)
    padded = np.zeros(groups * 8, np.uint64)
    padded[:count] = codes
    padded &= np.uint64((1 << bits) - 1)
    padded = padded.reshape(groups, 8)
    words = np.zeros((groups, 2), _WORD)
    lo, hi = words[:, 0], words[:, 1]
    for i in range(8):
        offset = i * bits
        column = padded[:, i]
        if offset + bits <= 64:
            lo |= column << np.uint64(offset)
        elif offset >= 64:
            hi |= column << np.uint64(offset - 64)
        else:  # straddles the two words: the uint64 shift drops the high part from lo
            lo |= column << np.uint64(offset)
            hi |= column >> np.uint64(64 - offset)
    stream = words.view(np.uint8).reshape(groups, 16)[:, :bits]
    return np.ascontiguousarray(stream).ravel()[:nbytes]


def unpack(data, bits, count):
    """Inverse of :func:`pack`: the first ``count`` codes of ``data``.

    data : uint8 array of at least ``ceil(count * bits / 8)`` bytes (extra bytes ignored).
    Returns a new array of ``count`` codes, uint8 for bits <= 8, uint16 otherwise.
    """
    bits = _check_bits(bits)
    count = int(count)
    out_dtype = np.uint8 if bits <= 8 else np.uint16
    if count == 0:
        return np.zeros(0, out_dtype)
    data = np.asarray(data, dtype=np.uint8).ravel()
    nbytes = (count * bits + 7) // 8
    if data.size < nbytes:
        raise ValueError(f"data holds {data.size} bytes, {nbytes} needed for {count} codes "
                         f"of {bits} bits")
    if 8 % bits == 0:
        return _unpack_within_bytes(data, bits, count, out_dtype)
    groups = -(-count // 8)
    stream = np.zeros(groups * bits, np.uint8)
    stream[:nbytes] = data[:nbytes]
    buf = np.zeros((groups, 16), np.uint8)
    buf[:, :bits] = stream.reshape(groups, bits)
    words = buf.view(_WORD)
    lo, hi = words[:, 0], words[:, 1]
    mask = np.uint64((1 << bits) - 1)
    out = np.empty((groups, 8), out_dtype)
    for i in range(8):
        offset = i * bits
        if offset + bits <= 64:
            column = lo >> np.uint64(offset)
        elif offset >= 64:
            column = hi >> np.uint64(offset - 64)
        else:
            column = (lo >> np.uint64(offset)) | (hi << np.uint64(64 - offset))
        out[:, i] = column & mask
    return out.ravel()[:count]


# Widths that divide 8 (1, 2, 4, 8 bits): no code straddles a byte, so the same stream
# is built in uint8 arithmetic, 8x less memory traffic than the 128-bit words above.

def _pack_within_bytes(codes, bits):
    per_byte = 8 // bits
    nbytes = -(-codes.size // per_byte)
    padded = np.zeros(nbytes * per_byte, np.uint8)
    padded[:codes.size] = codes & ((1 << bits) - 1)
    if bits == 1:
        return np.packbits(padded, bitorder="little")
    columns = padded.reshape(nbytes, per_byte)
    out = columns[:, 0].copy()
    for i in range(1, per_byte):
        out |= columns[:, i] << np.uint8(i * bits)
    return out


def _unpack_within_bytes(data, bits, count, out_dtype):
    per_byte = 8 // bits
    nbytes = -(-count // per_byte)
    stream = np.asarray(data, np.uint8).ravel()[:nbytes]
    if bits == 1:
        return np.unpackbits(stream, count=count, bitorder="little").astype(out_dtype, copy=False)
    mask = np.uint8((1 << bits) - 1)
    out = np.empty((nbytes, per_byte), np.uint8)
    for i in range(per_byte):
        out[:, i] = (stream >> np.uint8(i * bits)) & mask
    return out.ravel()[:count].astype(out_dtype, copy=False)
