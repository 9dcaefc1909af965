"""Where each gradient lives in a fused buffer, and a signature ranks can compare.

The sparse exchanges sum buffers position by position, so every rank must lay out
the same gradients in the same order. The layout's ``tag`` (a CRC32 of keys, shapes
and dtypes) is compared across ranks before each out-of-band step
(:func:`horovod_sparse.agreement.agree_on_layout`) and travels in the exchange engine's
agreement header (:meth:`horovod_sparse.exchange.SparseAllreduce.allreduce`), so a rank
whose layout differs raises an error on every rank instead of summing unrelated numbers.
"""
import zlib
from dataclasses import dataclass
from typing import Hashable, Tuple

import numpy as np

from horovod_sparse.ops.indices import searchsorted


def key_order(key):
    """Sort key of gradient keys: positions (ints) before names, each in order."""
    return isinstance(key, str), key


@dataclass(frozen=True)
class Entry:
    key: Hashable
    shape: Tuple[int, ...]
    dtype: str
    offset: int
    size: int


class GradientLayout:
    """An ordered list of gradients (key, shape, dtype) packed back to back.

    Example: ``GradientLayout([("fc.weight", (4, 4), "float32"), ("fc.bias", (4,), "float32")]).n == 20``.
    """

    def __init__(self, items):
        self.entries = []
        offset = 0
        for key, shape, dtype in items:
            size = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
            self.entries.append(Entry(key, tuple(shape), dtype, offset, size))
            offset += size
        self.n = offset
        self.by_key = {e.key: e for e in self.entries}
        self.starts = [e.offset for e in self.entries] + [offset]  # where each entry starts, then n
        self.tag = zlib.crc32(repr([(e.key, e.shape, e.dtype) for e in self.entries]).encode()) & 0x7FFFFFFF

    def __eq__(self, other):
        return isinstance(other, GradientLayout) and self.entries == other.entries

    def describe(self):
        return ", ".join(f"{e.key}:{e.dtype}{list(e.shape)}" for e in self.entries)

    def fuse(self, arrays):
        """One float32 buffer holding ``arrays`` (numpy, in layout order) back to back."""
        out = np.empty(self.n, dtype=np.float32)
        for entry, array in zip(self.entries, arrays):
            out[entry.offset:entry.offset + entry.size] = np.asarray(array, dtype=np.float32).reshape(-1)
        return out

    def split(self, buffer):
        """Views of ``buffer`` for each entry, reshaped, in layout order."""
        return [buffer[e.offset:e.offset + e.size].reshape(e.shape) for e in self.entries]



def sparse_bounds(layout, indices):
    """``[(lo, hi)]`` per entry of ``layout``: where its pairs lie in ``indices``, sorted int64
    indices into the fused buffer (numpy, torch or TensorFlow); one binary search per entry."""
    ends = searchsorted(indices, layout.starts)
    return list(zip(ends[:-1], ends[1:]))
