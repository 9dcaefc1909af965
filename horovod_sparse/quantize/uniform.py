"""Counter-based random numbers: the same stream from numpy and from torch (any device).

The stochastic codes (QSGD, TernGrad) need one uniform number per value, and a torch
tensor on a GPU must draw exactly what the numpy reference draws. So the numbers are a
hash of (seed, index) in 32-bit integer arithmetic, which both libraries compute
identically (int32 multiplication wraps modulo 2**32 in both):

1. keys: ``z = splitmix64(seed mod 2**64)``; ``k1`` = low 32 bits of z, ``k2`` = high 32 bits.
2. word ``j`` (j = 0, 1, ...), all modulo 2**32, ``>>`` a logical shift::

       x = j + k1
       x ^= x >> 16;  x *= 0x7feb352d;  x ^= k2
       x ^= x >> 16;  x *= 0x846ca68b;  x ^= x >> 16

   (Wellons' lowbias32 mixer, every shift 16, keyed twice).
3. value ``i`` takes the 16-bit half ``i % 2`` of word ``i // 2`` (the low half for even
   i), read as a signed int16 ``h_i`` in [-32768, 32767]; as a uniform number in (0, 1)
   it is ``u_i = (h_i + 32768.5) / 2**16``, the midpoint of one of 2**16 equal cells.

One hash gives two values, so a vector of n values costs n / 2 hashes. ``x ^= x >> 16``
is one in-place XOR of two int16 views (low half ^= high half), which needs no logical
shift (torch has none for int32). Words are little-endian int32 (x86, ARM, CUDA).
TensorFlow computes the words as uint32 (wrapping multiplication, logical shifts), like
numpy, into new tensors on the values' device: the same bits, drawn where the values are.
"""
import sys

import numpy as np

from horovod_sparse.ops import namespace

_MASK64 = (1 << 64) - 1
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - (1 << 32)  # the same 32 bits as a signed int32 constant


def splitmix64(z):
    """SplitMix64's output function of a Python int, modulo 2**64 (Steele et al., 2014)."""
    z = (int(z) + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed32(v):
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def stream_keys(seed):
    """(k1, k2): step 1 of the module docstring, as signed int32 Python ints."""
    z = splitmix64(int(seed) % (1 << 64))
    return _signed32(z), _signed32(z >> 32)


def random_int16(count, seed, scratch, like, start=0):
    """``h_start .. h_{start+count-1}`` of the module docstring (``start`` even): int16, in
    ``like``'s library and device, a view of ``scratch`` valid until its next use
    (TensorFlow: a new tensor; ``scratch`` unused)."""
    k1, k2 = stream_keys(seed)
    words = -(-int(count) // 2)
    if namespace.is_tensorflow(like):
        return _random_int16_tensorflow(count, words, k1, k2, like, start)
    if not namespace.is_torch(like):
        return _random_int16_numpy(count, words, k1, k2, scratch, start)
    lib = namespace.backend(like)
    x = scratch.get("random_words", words, "int32", like)
    lib.add(scratch.arange(words, like), _signed32(k1 + int(start) // 2), out=x)  # 2. x = j + k1
    halves = x.view(namespace.dtype_of(x, "int16")).reshape(words, 2)
    low, high = halves[:, 0], halves[:, 1]
    low ^= high                                              # x ^= x >> 16
    lib.multiply(x, _M1, out=x)
    x ^= k2
    low ^= high
    lib.multiply(x, _M2, out=x)
    low ^= high
    return x.view(namespace.dtype_of(x, "int16"))[:count]      # 3. the halves, in order


def _random_int16_numpy(count, words, k1, k2, scratch, start):
    """numpy's :func:`random_int16`: uint32 words, whose ``>>`` is the logical shift, so
    ``x ^= x >> 16`` is two contiguous vector passes (not one strided int16 pass)."""
    like = np.zeros(0, np.float32)
    x = scratch.get("random_words", words, "int32", like).view(np.uint32)
    shifted = scratch.get("random_shifted", words, "int32", like).view(np.uint32)
    np.add(scratch.arange(words, like).view(np.uint32), np.uint32((k1 + int(start) // 2) & 0xFFFFFFFF), out=x)
    for multiplier, key in ((_M1, k2), (_M2, None)):
        np.right_shift(x, 16, out=shifted)                   # x ^= x >> 16
        x ^= shifted
        np.multiply(x, np.uint32(multiplier & 0xFFFFFFFF), out=x)
        if key is not None:
            x ^= np.uint32(key & 0xFFFFFFFF)
    np.right_shift(x, 16, out=shifted)
    x ^= shifted
    return x.view(np.int16)[:count]


def _random_int16_tensorflow(count, words, k1, k2, like, start):
    """TensorFlow's :func:`random_int16`: numpy's steps on uint32 tensors, on ``like``'s device."""
    tf = sys.modules["tensorflow"]
    with tf.device(like.device):
        x = tf.range(words, dtype=tf.int64) + ((k1 + int(start) // 2) & 0xFFFFFFFF)
        x = tf.cast(tf.bitwise.bitwise_and(x, 0xFFFFFFFF), tf.uint32)    # 2. x = j + k1 (mod 2**32)
        sixteen = tf.constant(16, tf.uint32)
        for multiplier, key in ((_M1, k2), (_M2, None)):
            x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, sixteen))
            x = x * tf.constant(multiplier & 0xFFFFFFFF, tf.uint32)
            if key is not None:
                x = tf.bitwise.bitwise_xor(x, tf.constant(key & 0xFFFFFFFF, tf.uint32))
        x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, sixteen))
        return tf.reshape(tf.bitcast(x, tf.int16), [-1])[:count]
