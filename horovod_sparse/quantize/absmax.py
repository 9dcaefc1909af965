"""int4's value code: per bucket the largest magnitude, per value the nearest of 2L + 1 levels.

CocktailSGD (4 bits, 128 values and their max per bucket) and LoCo (arXiv 2407.04480: 4
bits with the error compensated). Against QSGD at the same bits it scales by the bucket's max
|x| instead of its L2 norm (of d normal values the norm is about sqrt(d) times a typical |x|,
the max a few times), and rounds to the nearest level, so its error per value is several
times smaller (docs/quantizers.md, ``studies/int4_error.py``).

It is QSGD's levels (:class:`~horovod_sparse.quantize.codecs._StochasticLevels`, over buckets
of ``bucket_size``) with two changes: the bucket's scale is its max |x|, and the rounding is to
the nearest level, not stochastic.
"""
import sys

import numpy as np

from horovod_sparse.checks import check_int
from horovod_sparse.ops import namespace

from .codecs import _FixedBuckets, _per_bucket, bucket_rows


class Int4Codec(_FixedBuckets):
    """Absmax levels (CocktailSGD; LoCo): ``bits`` per value, round to nearest, per bucket
    one float32 scale, the bucket's max |x|.

    Parameters
    ----------
    bits : int in [2, 8]
        Bits per value; the levels are {-L, .., L} * S / L with L = 2**(bits - 1) - 1
        (4 bits: L = 7, 15 of the 16 codes used; 3: L = 3; 2: L = 1; 8: L = 127, as
        :class:`horovod_sparse.torch.AdamW`'s exact steps in 8 bits use it).
    bucket_size : int in [1, 2**31 - 1]
        Values per bucket d (each bucket has its own scale); 128 by default.

    For a value x of a bucket with scale S = max |x| over the bucket (float32, exact: a max
    rounds nothing), or 0 where that max is below L * 2**-126 (so that S / L is never a
    denormal: TensorFlow flushes denormals on the CPU, and the bits must not depend on it):

    1. S = 0 or S not finite make the bucket *broken*: all its codes are L (level 0);
    2. ``level = round((x / S) * L)``, the quotient and the product each rounded to float32
       (a quotient, not x * (L / S): L / S would be a denormal for S > L * 2**126, which
       TensorFlow flushes), then to the nearest integer, ties to even (IEEE's default:
       numpy's ``rint``, torch's and TensorFlow's ``round`` agree bit for bit); |x / S| <= 1,
       so the level lies in [-L, L]; the code is ``level + L``;
    3. decode: ``(code - L) * (S / L)`` in float32.

    Deterministic: no seed, the same code every call. Round to nearest is biased per value
    (|error| <= S / (2L) plus float32 rounding), so use it with error feedback (the
    compressor's default): the residual carries each step's error into the next, which makes
    the sum of what is sent track the sum of the gradients.

    Layout (``nbytes(count) = 4 * ceil(count / bucket_size) + ceil(count * bits / 8)``):
    one float32 scale per bucket, in bucket order (float32 as every code here: a float16
    scale would overflow at 65504 and lose gradients below 6e-8), then the codes, ``bits``
    each, bit-packed LSB first.

    Non-finite: as QSGD's. A bucket holding an inf or NaN has a non-finite scale, gets all
    levels 0 and decodes as NaN entirely (0 * inf, 0 * NaN); other buckets are unaffected.
    A bucket of zeros, or whose max is below L * 2**-126 (about 8e-38 at 4 bits: denormals
    and the smallest normals), has scale 0 and decodes as 0.
    """

    name = "int4"
    stochastic = False

    def __init__(self, bits=4, bucket_size=128):
        bits = check_int("bits", bits, 2, 8)
        super().__init__(2 ** (bits - 1) - 1)
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2 ** 31 - 1)

    def _scales(self, x, bucket, scratch):
        count, buckets = x.shape[0], self._buckets(x.shape[0])
        if namespace.is_tensorflow(x):
            tf = sys.modules["tensorflow"]
            width = min(bucket, count)  # one bucket: no padding to a bucket_size far past count
            rows = tf.reshape(tf.pad(tf.abs(x), [[0, buckets * width - count]]), [buckets, width])
            nan = tf.reduce_any(tf.math.is_nan(rows), axis=1)  # tf's max skips NaN; numpy's keeps it
            scales = tf.where(nan, tf.constant(np.nan, tf.float32), tf.reduce_max(rows, axis=1))
            return tf.where(scales < self._smallest_scale(), tf.zeros_like(scales), scales)
        lib = namespace.backend(x)
        scales = scratch.get("scales", buckets, "float32", x)

        def magnitudes(block):
            return lib.abs(block, out=scratch.get("magnitudes", block.shape[0], "float32", x))

        def larger(total, part):  # one bucket longer than a block: the max of its blocks (NaN wins)
            lib.maximum(total, part, out=total)

        bucket_rows(x, bucket, scales, magnitudes, _row_max, larger)
        # scales below the smallest to 0, NaN and inf kept (NaN * 0 is NaN): a product, where
        # a masked store would read the mask's count back to the host on a GPU
        scales *= scales >= self._smallest_scale()
        return scales

    def _smallest_scale(self):
        """L * 2**-126: the smallest S whose level S / L is a normal float32."""
        return np.float32(self.levels * 2.0 ** -126)

    def _scaled(self, x, inv, scales, bucket, out):
        """(x / S) * L per bucket."""
        y = _per_bucket("divide", x, scales, bucket, out)
        if namespace.is_tensorflow(y):
            return y * np.float32(self.levels)
        y *= self.levels
        return y

    def _offset_levels(self, y, seed, start, scratch, like):
        """round(y) + L: the nearest level, ties to even, as the offset code (no random numbers)."""
        if namespace.is_tensorflow(y):
            return sys.modules["tensorflow"].math.round(y) + np.float32(self.levels)
        namespace.backend(y).round(y, out=y)
        y += self.levels
        return y

    def _fused_scales(self, x, scales):
        scales[...] = self._scales(x, self.bucket_size, self.scratch)  # numpy's passes; then the kernel
        return False

    def __repr__(self):
        return f"Int4Codec(bits={self.bits}, bucket_size={self.bucket_size})"


def _row_max(rows):
    """The max of each row, NaN where the row holds one (numpy's and torch's max propagate it)."""
    return sys.modules["torch"].amax(rows, dim=1) if namespace.is_torch(rows) else np.max(rows, axis=1)
