"""1-bit SGD's code over buckets: per bucket of ``bucket_size`` values its own two means.

Seide et al.'s 1-bit SGD (:class:`~horovod_sparse.quantize.codecs.OneBitCodec`) keeps two
reconstruction values per encoded vector: the mean of its non-negative and of its negative
entries. A transformer's gradient mixes rows of very different scales in one vector, so those
two means fit few of its values: on the study model's gradient the relative error of one encode
is 0.94 with a pair per chunk of the compressed allreduce and 0.60 over buckets of 256 values, a
row of its layers (``studies/onebit_buckets_error.py``).
Two float32 means per bucket cost 64 bits per bucket: 0.25 bits a value at 256.
"""
import sys

import numpy as np

from horovod_sparse.checks import check_int
from horovod_sparse.ops import namespace
from horovod_sparse.ops.cpu import quantize as fused

from .bitpack import packed_nbytes, padded_count, pack_into, unpack_into
from .codec import ValueCodec
from .codecs import _joined, _or_empty, _read_floats, _window, _write_floats
from .sums import tree_sum_rows

#: the smallest normal float32: below it a value counts as zero (the class docstring)
TINY = np.float32(2.0 ** -126)


class BucketedOneBitCodec(ValueCodec):
    """1-bit SGD's two means per bucket of ``bucket_size`` values (the last bucket may be shorter).

    For each bucket, of n values of which m are negative (x <= -2**-126: zeros, denormals and
    NaN are not):

    1. ``pos`` = (sum of the bucket's x >= 2**-126) / max(n - m, 1) and ``neg`` = (sum of its
       x <= -2**-126) / max(m, 1), float32: each side's values are x, or +0 for the other
       side's and for zeros and denormals (a NaN is on both sides), summed in the fixed-order
       tree of :mod:`.sums` over the bucket's own values; the divisions in float32, and a
       mean below 2**-126 in magnitude is +0;
    2. one bit per value, 1 where negative;
    3. decode: ``neg`` of the value's bucket where the bit is 1, else its ``pos``.

    Denormals count as zeros because TensorFlow flushes them on the CPU, in comparisons too
    (``-1e-41 < 0`` is False there), and the bits must not depend on the library.

    Deterministic and biased per value (it minimises the squared error for the given split),
    so use it with error feedback (the compressor's default). Non-finite: an inf makes its
    side's mean in that bucket inf, a NaN makes both of its bucket's means NaN; other buckets
    are unaffected.

    Layout (``nbytes(count) = 8 * ceil(count / bucket_size) + ceil(count / 8)``): per bucket,
    in bucket order, float32 ``pos`` then ``neg``; then the bits, bit-packed LSB first.

    Parameters
    ----------
    bucket_size : int in [1, 2**31 - 1]
        Values per bucket sharing two means.
    """

    name = "onebit"
    aggregate = "sum"

    def __init__(self, bucket_size=256):
        self.bucket_size = check_int("bucket_size", bucket_size, 1, 2 ** 31 - 1)

    @property
    def chunk_unit(self):
        """The compressed allreduce's chunks start at a bucket's start: a chunk starting mid-row
        would put two rows' scales in each of its buckets (on the study model's gradient cut at
        n // 2, half a row off: 0.75 error per encode against 0.60 cut at a row's start)."""
        return self.bucket_size

    def nbytes(self, count):
        return 8 * self._buckets(count) + packed_nbytes(count, 1)

    def _buckets(self, count):
        return -(-int(count) // self.bucket_size)

    def _groups(self, count):
        """(start, stop, width): the whole buckets as one matrix, then the short last bucket."""
        whole = count // self.bucket_size * self.bucket_size
        groups = [(0, whole, self.bucket_size)] if whole else []
        return groups + ([(whole, count, count - whole)] if whole < count else [])

    def _encode(self, x, seed, out, decoded):
        count = x.shape[0]
        means = _concat([_means(x[start:stop], width) for start, stop, width in self._groups(count)], x)
        head = _write_floats(out, means)
        bits = _negative_bits(x, self.scratch)
        stream = pack_into(bits, 1, count, _window(out, 8 * self._buckets(count)), self.scratch)
        if decoded is not None:
            decoded = self._decoded(_negative(x), means, count, decoded)
        return _joined(out, head, stream), decoded

    def _decode(self, data, count, out):
        buckets = self._buckets(count)
        means = _read_floats(data, 2 * buckets, self.scratch)
        bits = data[8 * buckets:]
        codes = None if namespace.is_tensorflow(data) else self.scratch.get("codes", padded_count(count), "uint8", data)
        return self._decoded(unpack_into(bits, 1, count, codes, self.scratch) != 0, means, count, out)

    def _decoded(self, negative, means, count, out):
        """``neg`` of each value's bucket where ``negative``, else its ``pos``: into ``out``
        (numpy, torch), or a new tensor (TensorFlow: ``out`` is True or None)."""
        parts, bucket = [], 0
        for start, stop, width in self._groups(count):
            rows = (stop - start) // width
            pairs = _reshape(means[2 * bucket:2 * (bucket + rows)], [rows, 2])
            part = _reshape(_where(_reshape(negative[start:stop], [rows, width]), pairs[:, 1:], pairs[:, :1]), [-1])
            if namespace.is_tensorflow(part):
                parts.append(part)
            else:
                out[start:stop] = part
            bucket += rows
        if namespace.is_tensorflow(means):
            return _concat(parts, means)
        return out

    fused_cpu = True

    def _encode_fused(self, x, seed, out, decoded, residual):
        """:meth:`_encode` by the compiled kernel (the same bits): one pass, bucket by bucket."""
        if not x.flags.c_contiguous:
            return False
        means = self.scratch.get("means", 2 * self._buckets(x.shape[0]), "float32", x)
        sides = self.scratch.get("sides", 2 * min(self.bucket_size, max(x.shape[0], 1)), "float32", x)
        fused.bucket_one_bit_encode(x, self.bucket_size, TINY, means, out[means.shape[0] * 4:], _or_empty(decoded),
                                    _or_empty(residual), sides.reshape(2, -1))
        _write_floats(out, means)
        return True

    def _decode_fused(self, data, count, out):
        buckets = self._buckets(count)
        means = _read_floats(data, 2 * buckets, self.scratch)
        fused.bucket_one_bit_decode(data[8 * buckets:], count, self.bucket_size, means, out)
        return True

    def __repr__(self):
        return f"BucketedOneBitCodec(bucket_size={self.bucket_size})"


def _negative(x):
    """x <= -2**-126: the values whose bit is 1 (bool, new)."""
    return x <= -TINY


def _negative_bits(x, scratch):
    """uint8 0/1 per value, 1 where :func:`_negative`, in a zero-padded buffer of
    ``padded_count`` values (the 1-bit packer's input; TensorFlow: a new tensor of ``count``)."""
    if namespace.is_tensorflow(x):
        return sys.modules["tensorflow"].cast(_negative(x), sys.modules["tensorflow"].uint8)
    count = x.shape[0]
    mask = scratch.get("negative", padded_count(count), "bool", x)
    namespace.backend(x).less_equal(x, -TINY, out=mask[:count])
    mask[count:] = False
    return mask.view(namespace.dtype_of(mask, "uint8"))


def _means(values, width):
    """float32 [pos, neg] of each bucket of ``width`` values, flattened in bucket order."""
    rows = _reshape(values, [-1, width])
    zero = _zeros_like(rows)
    sides = _concat([_where(rows < TINY, zero, rows), _where(rows > -TINY, zero, rows)], rows)  # [2 buckets, width]
    sums = tree_sum_rows(sides)
    buckets = values.shape[0] // width
    negatives = _count_rows(_negative(rows))
    if namespace.is_tensorflow(rows):
        tf = sys.modules["tensorflow"]
        means = tf.reshape(tf.stack([sums[:buckets] / tf.maximum(width - negatives, 1),
                                     sums[buckets:] / tf.maximum(negatives, 1)], 1), [-1])
        return tf.where(tf.abs(means) < TINY, tf.zeros_like(means), means)
    lib = namespace.backend(rows)
    means = lib.stack([sums[:buckets] / lib.maximum(width - negatives, _one(rows)),
                       sums[buckets:] / lib.maximum(negatives, _one(rows))], 1).reshape(-1)
    return _where(lib.abs(means) < TINY, _zeros_like(means), means)


# one spelling over numpy, torch and TensorFlow for the few operations above
def _tf_or(x):
    return sys.modules["tensorflow"] if namespace.is_tensorflow(x) else None


def _reshape(x, shape):
    tf = _tf_or(x)
    return tf.reshape(x, shape) if tf else x.reshape(shape)


def _where(condition, yes, no):
    tf = _tf_or(yes)
    if tf:
        return tf.where(condition, yes, no)
    return namespace.namespace(yes).where(condition, yes, no)


def _zeros_like(x):
    tf = _tf_or(x)
    return tf.zeros_like(x) if tf else namespace.namespace(x).zeros_like(x)


def _concat(parts, like):
    """The parts along their first axis (float32 rows or 1-D), or an empty float32 vector."""
    tf = _tf_or(like)
    if not parts:
        return tf.zeros([0], tf.float32) if tf else namespace.empty(0, "float32", like)
    if len(parts) == 1:
        return parts[0]
    return tf.concat(parts, 0) if tf else namespace.namespace(like).concat(parts, axis=0)


def _count_rows(mask):
    """float32 count of True per row (exact: counts below 2**24)."""
    tf = _tf_or(mask)
    if tf:
        return tf.reduce_sum(tf.cast(mask, tf.float32), 1)
    xp = namespace.namespace(mask)
    return xp.astype(xp.sum(mask, axis=1), xp.float32)


def _one(like):
    """float32 1 in ``like``'s library and device (torch's maximum takes no Python number)."""
    if namespace.is_torch(like):
        return sys.modules["torch"].ones((), dtype=like.dtype, device=like.device)
    return np.float32(1)
