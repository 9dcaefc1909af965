"""Decoding 1- and 2-bit codes straight from their bytes: one table row per byte.

A byte of the bit stream (:mod:`.bitpack`'s layout) holds 8 codes of 1 bit, or 4 of 2
bits, and such a code decodes to one of 2 (4) float32 values per call. So a table of
256 rows, row b holding the 8 (4) floats of byte b, turns the stream into floats with
one row copy per byte: one pass writing the floats, no unpacked codes, no integer
passes. The table (8 KB) is built per call from the 2 or 4 values, by indexing, so its
floats are those values bit for bit.

Example::

    values = np.float32([1, -1])                  # code 0 -> +1, code 1 -> -1
    out = np.empty(10, np.float32)
    decode_small_codes(np.uint8([0b101, 0b10]), 1, 10, values, out)
    # out = [-1, 1, -1, 1, 1, 1, 1, 1, 1, -1]
"""
import sys

import numpy as np

from horovod_sparse.ops import namespace

#: code of value k of byte b, per code width: _CODE_OF[bits][b, k] (int64)
_CODE_OF = {bits: ((np.arange(256)[:, None] >> (bits * np.arange(8 // bits))) & ((1 << bits) - 1))
            for bits in (1, 2)}


def decode_small_codes(data, bits, count, values, out, use_torch=None):
    """``out[i] = values[code i]`` for the first ``count`` codes of the uint8 stream ``data``.

    bits : 1 or 2. values : 1-D float32 of 2**bits entries. data, values, out : the same
    library and device. use_torch : copy the rows with torch's index_select (~5x faster
    than numpy's take; numpy arrays are viewed as tensors, zero-copy, so the floats are
    the same); None (default) means whenever torch is loaded. Returns ``out`` (TensorFlow:
    a new tensor, the same floats; ``out`` may be None).
    """
    if namespace.is_tensorflow(data):  # a new tensor: each code's value gathered (``out`` unused)
        from .bitpack import unpack_into
        return sys.modules["tensorflow"].gather(values, unpack_into(data, bits, count, None, None))
    per = 8 // bits
    whole, tail = divmod(int(count), per)
    torch = sys.modules.get("torch") if use_torch is not False else None
    if torch is None:
        table = values[_CODE_OF[bits]]
        np.take(table, data[:whole], axis=0, out=out[:whole * per].reshape(whole, per))
        if tail:
            out[whole * per:count] = table[data[whole], :tail]
        return out
    as_tensor = (lambda a: a) if namespace.is_torch(out) else torch.from_numpy
    data, values, target = as_tensor(data), as_tensor(values), as_tensor(out)
    table = values[torch.from_numpy(_CODE_OF[bits]).to(values.device)]
    rows = data[:whole + (1 if tail else 0)].long()
    torch.index_select(table, 0, rows[:whole], out=target[:whole * per].view(whole, per))
    if tail:
        target[whole * per:count] = table[rows[whole], :tail]
    return out
