"""Sums in a fixed order, so numpy and torch (any device) give bitwise the same float32.

A library's own ``sum`` picks its order (numpy: pairwise blocks of 8; torch: vector
lanes, threads, GPU blocks), so the last bits differ. The codes' headers (norms, means)
must not: they are summed here as a pairwise tree of elementwise float32 additions,
whose order is the definition:

    width w = row length; while w > 1: h = w // 2; row[:h] += row[w - h:w]; w -= h

i.e. element j of the first half gets element j + (w - h) (the middle element of an
odd width waits a round). Each round is one elementwise add over all rows at once,
about log2(w) calls; the error grows like log2(w) roundings, not w.

TensorFlow tensors (immutable) get the same rounds as new tensors: the same additions, so
the same bits.
"""
import sys

from horovod_sparse.ops.namespace import is_tensorflow


def tree_sum_rows(matrix):
    """Row sums of a 2-D float32 ``matrix`` (numpy or torch), summed in place.

    Destroys ``matrix``; returns its first column (a view: copy it before reusing the
    memory; TensorFlow: a new tensor). A row of width 0 is not allowed.
    """
    width = int(matrix.shape[1])
    if is_tensorflow(matrix):
        tf = sys.modules["tensorflow"]
        while width > 1:
            half = width // 2
            matrix = tf.concat([matrix[:, :half] + matrix[:, width - half:width], matrix[:, half:width - half]], 1)
            width -= half
        return matrix[:, 0]
    while width > 1:
        half = width // 2
        matrix[:, :half] += matrix[:, width - half:width]
        width -= half
    return matrix[:, 0]
