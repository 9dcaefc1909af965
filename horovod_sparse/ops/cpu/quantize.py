"""The quantizers' hot passes, compiled: scale, encode, pack, decode (their first pass, the
memory with the overflow check, is :mod:`horovod_sparse.ops.cpu.memory`'s).

Each kernel replaces several numpy passes of :mod:`horovod_sparse.quantize` (named in its
docstring) by one loop that does the float32 work of an element while it is in registers,
with the same IEEE operations in the same order, so the bytes and floats are the numpy
path's, bit for bit (no fast-math: LLVM neither reassociates nor fuses a multiply-add):

* :func:`tree_sums`: the fixed-order tree sums of :mod:`horovod_sparse.quantize.sums` of
  |x|, or of x's positive and negative sides, in one read of x (the first rounds of the
  tree pair elements half a row apart: 16 streams read side by side, see the docstring);
* :func:`sign_encode`: sign bits packed, and what the code decodes to, and acc minus it;
* :func:`levels_encode` / :func:`levels_decode`: QSGD's and TernGrad's stochastic levels
  (the counter-based random numbers of :mod:`horovod_sparse.quantize.uniform` computed 2048
  values at a time into a small scratch, not drawn into an n-long buffer), or int4's nearest
  ones, packed, and the decoded floats, per bucket;
* :func:`one_bit_decode`: a 1-bit code to its two values; :func:`one_bit_sum_of_two`: two
  such codes to the sum of their values (the compressed allreduce at P = 2).

Callers (the codecs, the pipeline) take these when :func:`horovod_sparse.ops.cpu.enabled`
and the arrays are numpy (CPU tensors as zero-copy numpy views); else the numpy code, the
reference.

Example::

    from horovod_sparse.ops import cpu
    from horovod_sparse.ops.cpu import quantize as fused
    if cpu.enabled():
        fused.sign_encode(acc, code, values, decoded, residual)
"""
import numpy as np

from horovod_sparse.ops.cpu import inlined, jit, load_le64, negative_bits64, store_le64

_BLOCK = 4096               # values per block of a two-loop kernel (in L1)
_STREAM_LEVELS = 2          # tree rounds done in L1: 2**2 streams of x read side by side (measured best)
_LANES = 256                # values per stream and block of tree_sums
_MASK32 = 0xFFFFFFFF
_M1 = 0x7FEB352D
_M2 = 0x846CA68B


@jit
def subtract_into(acc, consumed):
    """acc -= consumed in float32, in place: :meth:`ErrorFeedback.commit_minus`'s subtract on
    numpy views (a CPU tensor's torch subtract is slower, the same IEEE differences)."""
    for i in range(acc.shape[0]):
        acc[i] = acc[i] - consumed[i]


# ------------------------------------------------------------------------ tree sums
@inlined
def _rounds(row, width):
    """:func:`horovod_sparse.quantize.sums.tree_sum_rows` of one row, in place: row[0]."""
    while width > 1:
        half = width // 2
        low, high = row[:half], row[width - half:width]   # views: indices from 0 let LLVM vectorise
        for j in range(half):
            low[j] = low[j] + high[j]
        width -= half
    return row[0]


@inlined
def _plan(width, levels):
    """(widths, offsets, fast): the row widths after each of ``levels`` tree rounds, the
    offset of each of the 2**levels leaves of a final element (bit b of the leaf set adds
    widths[b + 1]), and the number of final elements whose leaves all pair (no middle
    element of an odd width waits on their paths)."""
    widths = np.empty(levels + 1, np.int64)
    widths[0] = width
    for level in range(1, levels + 1):
        widths[level] = widths[level - 1] - widths[level - 1] // 2
    offsets = np.zeros(1 << levels, np.int64)
    for leaf in range(1 << levels):
        for b in range(levels):
            if (leaf >> b) & 1:
                offsets[leaf] += widths[b + 1]
    fast = widths[levels]
    for level in range(1, levels + 1):
        above = 0
        for b in range(level + 1, levels + 1):
            above += widths[b]
        fast = min(fast, widths[level - 1] // 2 - above)
    return widths, offsets, max(fast, 0)


@inlined
def _combine(leaves, present, count, lanes):
    """Pairwise rounds over the leaves (bit 0 first: the first round's pairs), each pair
    ``lower + upper`` in that order, an absent upper leaf leaving the lower as it is."""
    while count > 1:
        count //= 2
        for t in range(count):
            target, lower, upper = leaves[t], leaves[2 * t], leaves[2 * t + 1]
            if present[2 * t + 1]:
                for b in range(lanes):
                    target[b] = lower[b] + upper[b]
            else:
                for b in range(lanes):
                    target[b] = lower[b]
            present[t] = present[2 * t]


@inlined
def _load(xs, leaves, leaf, count, lanes, mode):
    """The rows' leaf ``leaf`` of the values xs[:lanes] (row r in leaves[r * count + leaf]):
    mode 0 |x|; mode 1 numpy's clip(x, 0, None) and clip(x, None, 0) (-0 becomes +0, NaN
    stays); one vectorised loop each. Returns the count of xs < 0 (mode 1; else 0)."""
    negatives = 0
    if mode == 0:
        ls = leaves[leaf]
        for b in range(lanes):
            ls[b] = abs(xs[b])
        return 0
    high, low = leaves[leaf], leaves[count + leaf]
    for b in range(lanes):
        v = xs[b]
        high[b] = v if (v > 0 or v != v) else np.float32(0)
        low[b] = v if (v < 0 or v != v) else np.float32(0)
        negatives += v < 0
    return negatives


@inlined
def _leaf_index(j, leaf, levels, widths):
    """``(index, present)``: where leaf ``leaf`` of the first ``levels`` tree rounds reads x for
    output position ``j``, and whether that element exists (its path may run past a row's end)."""
    index = j
    for level in range(levels, 0, -1):
        if (leaf >> (level - 1)) & 1:
            if index >= widths[level - 1] // 2:
                return index, False
            index += widths[level]
    return index, True


@jit
def _tree_sums(x, mode, rows, rest):
    """The kernel of :func:`tree_sums`; ``rest`` is float32 (rows, widths[levels]) scratch."""
    n = x.shape[0]
    levels = 0
    while levels < _STREAM_LEVELS and (n >> (levels + 1)) >= _LANES:
        levels += 1
    widths, offsets, fast = _plan(n, levels)
    count = 1 << levels
    final = widths[levels]
    leaves = np.empty((rows * count, _LANES), np.float32)
    present = np.ones(count, np.bool_)
    negatives = 0
    for j0 in range(0, fast, _LANES):           # every leaf pairs: 2**levels streams, vectorised
        lanes = min(_LANES, fast - j0)
        for leaf in range(count):
            base = j0 + offsets[leaf]
            negatives += _load(x[base:base + lanes], leaves, leaf, count, lanes, mode)
        for row in range(rows):
            present[:] = True
            _combine(leaves[row * count:(row + 1) * count], present, count, lanes)
            target, first = rest[row, j0:j0 + lanes], leaves[row * count]
            for b in range(lanes):
                target[b] = first[b]
    for j in range(fast, final):                # the few whose paths meet a waiting middle
        for leaf in range(count):
            index, ok = _leaf_index(j, leaf, levels, widths)
            if ok:
                negatives += _load(x[index:index + 1], leaves, leaf, count, 1, mode)
        for row in range(rows):
            for leaf in range(count):           # presence again (the combine overwrites it)
                present[leaf] = _leaf_index(j, leaf, levels, widths)[1]
            _combine(leaves[row * count:(row + 1) * count], present, count, 1)
            rest[row, j] = leaves[row * count, 0]
    sums = np.empty(rows, np.float32)
    for row in range(rows):
        sums[row] = _rounds(rest[row], final)
    return sums, negatives


def tree_sums(x, mode, scratch):
    """(sums, negatives): the fixed-order tree sums (:mod:`horovod_sparse.quantize.sums`) of
    mode 0: |x| (one row; ScaledSignCodec's header); mode 1: clip(x, 0, None) and
    clip(x, None, 0) (two rows; OneBitCodec's) with the count of x < 0. x: float32, n >= 1.

    Replaces the codecs' numpy abs/clip into a scratch row, tree_sum_rows' log2(n) passes
    and count_nonzero: x is read once. The first rounds of the tree add x[j] to x[j + w/2]:
    the kernel reads 2**2 streams of x at the leaves' offsets, sums each element's 4
    leaves in the tree's order in L1, and only the n/4 partial sums go through the
    remaining rounds. The same additions, the same operands in the same order: the same bits.
    ``scratch`` is a :class:`~horovod_sparse.quantize.scratch.Scratch` (no allocation per call)."""
    rows, width, levels = (1 if mode == 0 else 2), int(x.shape[0]), 0
    while levels < _STREAM_LEVELS and (width >> (levels + 1)) >= _LANES:
        levels += 1
    for _ in range(levels):
        width -= width // 2
    rest = scratch.get("tree_rest", rows * width, "float32", x).reshape(rows, width)
    return _tree_sums(x, mode, rows, rest)


# ------------------------------------------------------------------------ sign codes
@inlined
def _signs_of(xs, lanes):
    """Bit b set where xs[b] < 0, for b < lanes (<= 64)."""
    mask = np.uint64(0)
    for b in range(lanes):
        if xs[b] < 0:
            mask |= np.uint64(1) << np.uint64(b)
    return mask


@jit
def sign_encode(x, out, values, decoded, residual):
    """The 1-bit sign code of x into ``out`` (bit 1 where x < 0, LSB first: :mod:`.bitpack`);
    ``decoded`` (if not empty) = values[bit]; ``residual`` (if not empty) = x - values[bit].
    x: C-contiguous.

    Replaces :func:`horovod_sparse.quantize.codecs._negative_bits` + ``pack_into`` (np.packbits)
    + ``decode_small_codes`` of the code + the pipeline's commit subtract: one pass, 64 values
    at a time (a word of bits by one vector compare, then vectorised selects)."""
    n = x.shape[0]
    want_decoded, want_residual = decoded.shape[0] > 0, residual.shape[0] > 0
    v0, v1 = values[0], values[1]
    for w0 in range(0, n, 64):
        lanes = min(64, n - w0)
        xs = x[w0:w0 + lanes]
        mask = negative_bits64(x, w0) if lanes == 64 else _signs_of(xs, lanes)
        o = out[w0 // 8:w0 // 8 + (lanes + 7) // 8]
        for q in range((lanes + 7) // 8):
            o[q] = np.uint8((mask >> np.uint64(8 * q)) & np.uint64(0xFF))
        if want_decoded:
            ds = decoded[w0:w0 + lanes]
            for b in range(lanes):
                ds[b] = v1 if xs[b] < 0 else v0
        if want_residual:
            rs = residual[w0:w0 + lanes]
            for b in range(lanes):
                rs[b] = xs[b] - (v1 if xs[b] < 0 else v0)


@inlined
def _word(data, w0, lanes):
    """The bits of values w0 .. w0 + lanes - 1 of a 1-bit code (LSB first) as one uint64."""
    word = np.uint64(0)
    for q in range((lanes + 7) // 8):
        word |= np.uint64(data[w0 // 8 + q]) << np.uint64(8 * q)
    return word


@jit
def one_bit_decode(data, count, values, out):
    """out[i] = values[bit i of data] for the first ``count`` bits (LSB first).
    Replaces :func:`horovod_sparse.quantize.lookup.decode_small_codes` for 1 bit."""
    v0, v1 = values[0], values[1]
    for w0 in range(0, count, 64):                 # 64 values a word: the select loop vectorises
        lanes = min(64, count - w0)
        word = _word(data, w0, lanes)
        os = out[w0:w0 + lanes]
        for b in range(lanes):
            os[b] = v1 if (word >> np.uint64(b)) & np.uint64(1) else v0


@jit
def one_bit_sum_of_two(first, first_values, second, second_values, count, out):
    """out[i] = first_values[bit i of first] + second_values[bit i of second] (float32, that
    order) for the first ``count`` bits: two 1-bit codes decoded and added in one pass, where
    :func:`one_bit_decode` twice and an add write and read two float buffers."""
    a0, a1, b0, b1 = first_values[0], first_values[1], second_values[0], second_values[1]
    for w0 in range(0, count, 64):
        lanes = min(64, count - w0)
        first_word, second_word = _word(first, w0, lanes), _word(second, w0, lanes)
        os = out[w0:w0 + lanes]
        for b in range(lanes):
            a = a1 if (first_word >> np.uint64(b)) & np.uint64(1) else a0
            c = b1 if (second_word >> np.uint64(b)) & np.uint64(1) else b0
            os[b] = a + c


@jit
def max_magnitude(x, scale):
    """scale[0] = max(|min x|, |max x|) of a non-empty float32 x: TernGradCodec's scale
    (numpy's min and max, then abs and maximum). As integers, the bits of |v| (sign cleared)
    order as the magnitudes do, +-0 give 0 and a NaN is above inf: so an integer maximum
    (a reduction LLVM vectorises, where a float one with NaN rules stays scalar) is the
    answer. A NaN anywhere gives |NaN| (numpy's min/max propagate NaN; with several NaNs of
    different payloads the two may carry different ones: only the NaN header's payload)."""
    bits = x.view(np.uint32)
    top = np.uint32(0)
    for i in range(bits.shape[0]):
        m = bits[i] & np.uint32(0x7FFFFFFF)
        top = m if m > top else top
    scale.view(np.uint32)[0] = top


# -------------------------------------------------------------- stochastic levels
@inlined
def _random_words(first_word, count, k1, k2, words):
    """words[p] = word first_word + p of :mod:`horovod_sparse.quantize.uniform` (uint64
    arithmetic masked to 32 bits: the wrapping uint32 of numpy's path), p < count. One hash
    gives two values' random int16: read them through an int16 view of ``words``."""
    mask, sixteen = np.uint64(_MASK32), np.uint64(16)
    for p in range(count):
        x = (first_word + np.uint64(p) + k1) & mask
        x ^= x >> sixteen
        x = (x * np.uint64(_M1)) & mask
        x ^= k2
        x ^= x >> sixteen
        x = (x * np.uint64(_M2)) & mask
        x ^= x >> sixteen
        words[p] = np.uint32(x)


@inlined
def _bucket_norm(x, start, stop, block, row):
    """QSGD's norm of the bucket x[start:stop]: sqrt (IEEE, correctly rounded) of the tree sum
    of its squares; a bucket longer than ``block`` (then the only bucket) sums its blocks'
    trees in order, as QSGDCodec._scales does block by block."""
    total = np.float32(0)
    for p0 in range(start, stop, block):
        width = min(block, stop - p0)
        xs, squares = x[p0:p0 + width], row[:width]
        for j in range(width):
            squares[j] = xs[j] * xs[j]
        part = _rounds(row, width)
        total = part if p0 == start else total + part
    return np.sqrt(total)


@inlined
def _levels(xs, codes, inv, levels, first, k1, k2, words):
    """codes[t] = trunc(xs[t] * inv + (h + 65536 s + 32768.5) * 2**-16), h the random int16 of
    value first + t, clipped to [0, 2s] for s > 31 (step 2 of QSGDCodec._encode). A block at a
    time: the block's hash words into ``words`` (uint32 scratch; one hash per two values),
    then the codes reading them as int16. Every index starts at 0 and nothing branches per
    value, so LLVM vectorises both loops (one loop indexed from the bucket's start, hashing each
    value, did not)."""
    offset = np.float32(65536.0 * levels + 32768.5)
    scale16 = np.float32(2.0 ** -16)
    zero, high = np.float32(0), np.float32(2 * levels)
    halves = words.view(np.int16)
    span = 2 * (words.shape[0] - 1)                 # values per block (one word spare: odd starts)
    for a in range(0, xs.shape[0], span):
        m = min(span, xs.shape[0] - a)
        i0 = first + a
        odd = i0 & 1
        _random_words(np.uint64(i0 >> 1), (odd + m + 1) // 2, k1, k2, words)
        hs, xa, ca = halves[odd:odd + m], xs[a:a + m], codes[a:a + m]
        if levels > 31:
            for t in range(m):
                ca[t] = min(max(xa[t] * inv + (np.float32(hs[t]) + offset) * scale16, zero), high)
        else:
            for t in range(m):
                ca[t] = xa[t] * inv + (np.float32(hs[t]) + offset) * scale16


@inlined
def _nearest_levels(xs, codes, scale, s):
    """codes[t] = rint(xs[t] / S * s) + s: int4's nearest level, ties to even (step 2 of
    :class:`horovod_sparse.quantize.absmax.Int4Codec`; rint is IEEE's round to nearest even)."""
    for t in range(xs.shape[0]):
        codes[t] = np.rint(xs[t] / scale * s) + s


@inlined
def _bucket_levels(xs, cs, scale, inv, s, levels, first, k1, k2, words, nearest):
    """One bucket's codes (or its part in a chunk): level 0 (code ``levels``) where the bucket is
    broken (S = 0 or not finite), else int4's nearest levels (``nearest``) or QSGD's stochastic
    ones, values ``first`` .. of the stream."""
    if not (np.isfinite(inv) and np.isfinite(scale)):
        cs[:] = levels
    elif nearest:
        _nearest_levels(xs, cs, scale, s)
    else:
        _levels(xs, cs, inv, levels, first, k1, k2, words)


@inlined
def _decoded_and_residual(xs, codes, step, s, decoded, residual):
    """decoded = (code - s) * step and residual = x - that, where they are wanted (the caller's
    empty arrays slice to empty views)."""
    if decoded.shape[0] > 0 and residual.shape[0] > 0:     # both: one loop, the same operations
        for t in range(codes.shape[0]):
            value = (np.float32(codes[t]) - s) * step
            decoded[t] = value
            residual[t] = xs[t] - value
        return
    if decoded.shape[0] > 0:
        for t in range(codes.shape[0]):
            decoded[t] = (np.float32(codes[t]) - s) * step
    if residual.shape[0] > 0:
        for t in range(codes.shape[0]):
            residual[t] = xs[t] - (np.float32(codes[t]) - s) * step


@inlined
def _pack_group(codes, at, bits, out, first, nbytes):
    """Bytes [first, first + nbytes) of the stream of the 8 codes codes[at:at + 8] of ``bits``
    > 8 bits (two words; :func:`_pack_small` packs the narrower codes)."""
    low = np.uint64(0)
    high = np.uint64(0)
    for k in range(8):
        shift = k * bits
        c = np.uint64(codes[at + k])
        if shift < 64:
            low |= c << np.uint64(shift)
            if shift + bits > 64:
                high |= c >> np.uint64(64 - shift)
        else:
            high |= c << np.uint64(shift - 64)
    for q in range(nbytes):
        word = low if q < 8 else high
        out[first + q] = np.uint8((word >> np.uint64(8 * (q % 8))) & np.uint64(0xFF))


@inlined
def _pack_small(codes, count, bits, out, start, total_bytes, words):
    """The stream's bytes from ``start`` of the ``count`` codes of ``bits`` <= 8 bits in the uint8
    ``codes`` (zero-padded to a multiple of 8): each 8 codes (8 bytes, one uint64) squeezed into
    one word by shifts (vectorised over the groups, into the uint64 scratch ``words``), then
    written by one 8-byte store (the next group overwrites the zeros past its ``bits`` bytes;
    the stream's last bytes one at a time)."""
    groups = (count + 7) // 8
    eights = codes[:8 * groups].view(np.uint64)
    mask, width = np.uint64((1 << bits) - 1), np.uint64(bits)
    for g in range(groups):
        w = eights[g]
        word = w & mask
        for k in range(1, 8):
            word |= ((w >> np.uint64(8 * k)) & mask) << (width * np.uint64(k))
        words[g] = word
    for g in range(groups):
        first = start + g * bits
        if total_bytes - first >= 8:
            store_le64(out, first, words[g])
        else:
            for q in range(min(bits, total_bytes - first)):
                out[first + q] = np.uint8((words[g] >> np.uint64(8 * q)) & np.uint64(0xFF))


_CHUNK = 2048  # values per chunk of levels_encode: codes computed, then packed (a multiple of 8)


@jit
def levels_encode(x, scales, norms_here, bucket, block, levels, bits, k1, k2, start, out, decoded, residual,
                  row, codes, nearest=False):
    """The stochastic levels of :class:`horovod_sparse.quantize.codecs._StochasticLevels`
    (``nearest``: int4's, :func:`_nearest_levels` instead of :func:`_levels`).

    Per bucket of ``bucket`` values, scale S = ``scales[bucket]`` (``norms_here``: QSGD's norm,
    computed here as the bucket is reached and written into ``scales``); inv = s / S, step = S / s;
    y = x * inv + (h + 65536 s + 32768.5) * 2**-16 (h of :mod:`horovod_sparse.quantize.uniform`,
    computed a block at a time), code = trunc(y) (s in a broken bucket: S or inv not finite; clipped
    to [0, 2s] for s > 31), packed ``bits`` each from byte 0 of ``out``; ``decoded`` (if not
    empty) = (code - s) * step; ``residual`` (if not empty) = x - that.

    Replaces QSGDCodec._scales (squares, tree_sum_rows, _sqrt), _inverse, random_int16, _noise,
    _per_bucket, _plus, _broken_rows, _clipped, _codes, pack_into, _values and the pipeline's
    commit subtract: one read of x, in L1. 8-bit codes (s = 127, QSGD's 8-bit setting) are their
    own bytes: written into ``out`` bucket by bucket, no packing; other widths are computed a
    chunk at a time into ``codes`` and packed (:func:`_pack_small` below 8 bits). ``k1``, ``k2``:
    the stream keys as uint64 of their 32 bits; ``start``: x[0]'s index in the stream (even);
    ``block``: see :func:`_bucket_norm`; ``row``: float32 scratch of min(bucket, block, n);
    ``codes``: scratch of _CHUNK, uint8 below 8 bits, else int32 (not int64: AVX2 has no
    vector conversion from float to int64, and that loop ran scalar at twice the time)."""
    n = x.shape[0]
    s = np.float32(levels)
    words = np.empty(_CHUNK // 2 + 1, np.uint32)   # a block's random words (_levels)
    groups = np.empty(_CHUNK // 8, np.uint64)       # a chunk's packed 8-code groups (_pack_small)
    if bits == 8:
        for b in range((n + bucket - 1) // bucket):
            lo, hi = b * bucket, min(n, (b + 1) * bucket)
            if norms_here:
                scales[b] = _bucket_norm(x, lo, hi, block, row)
            scale = scales[b]
            inv, step = s / scale, scale / s
            cs = out[lo:hi]
            _bucket_levels(x[lo:hi], cs, scale, inv, s, levels, start + lo, k1, k2, words, nearest)
            _decoded_and_residual(x[lo:hi], cs, step, s, decoded[lo:hi], residual[lo:hi])
        return
    total_bytes = (n * bits + 7) // 8
    for c0 in range(0, n, _CHUNK):
        c1 = min(c0 + _CHUNK, n)
        i = c0
        while i < c1:                                   # the chunk's codes, bucket by bucket
            b = i // bucket
            stop = min(c1, (b + 1) * bucket)
            if norms_here and i == b * bucket:
                scales[b] = _bucket_norm(x, i, min(n, (b + 1) * bucket), block, row)
            scale = scales[b]
            inv, step = s / scale, scale / s
            cs = codes[i - c0:stop - c0]
            _bucket_levels(x[i:stop], cs, scale, inv, s, levels, start + i, k1, k2, words, nearest)
            _decoded_and_residual(x[i:stop], cs, step, s, decoded[i:stop], residual[i:stop])
            i = stop
        for k in range(c1 - c0, ((c1 - c0 + 7) // 8) * 8):
            codes[k] = 0
        if bits < 8:                                    # then packed, 8 codes = ``bits`` bytes
            _pack_small(codes, c1 - c0, bits, out, c0 * bits // 8, total_bytes, groups)
            continue
        for g in range(0, c1 - c0, 8):
            first = (c0 + g) * bits // 8
            _pack_group(codes, g, bits, out, first, min(bits, total_bytes - first))


@inlined
def _unpack_small(data, start, total_bytes, bits, groups, words, codes):
    """The inverse of :func:`_pack_small`: ``groups`` 8-code groups of the stream from byte
    ``start`` into the uint8 ``codes``, a code per byte. Each group's ``bits`` bytes by one
    8-byte load (the bytes past them masked off; the stream's last bytes one at a time), then
    spread to 8 bytes by shifts, vectorised over the groups."""
    for g in range(groups):
        first = start + g * bits
        if total_bytes - first >= 8:
            words[g] = load_le64(data, first)
        else:
            word = np.uint64(0)
            for q in range(min(bits, total_bytes - first)):
                word |= np.uint64(data[first + q]) << np.uint64(8 * q)
            words[g] = word
    eights = codes[:8 * groups].view(np.uint64)
    mask, width = np.uint64((1 << bits) - 1), np.uint64(bits)
    for g in range(groups):
        w = words[g]
        spread = w & mask
        for k in range(1, 8):
            spread |= ((w >> (width * np.uint64(k))) & mask) << np.uint64(8 * k)
        eights[g] = spread


@jit
def levels_decode(data, count, scales, bucket, levels, bits, out):
    """out = (code - s) * (S / s) for the ``count`` codes packed in ``data`` (after the header),
    bucket by bucket. Replaces unpack_into + _values (or the lookup table of TernGrad). Codes
    below 8 bits are unpacked a chunk at a time into bytes (:func:`_unpack_small`), then
    turned into floats bucket by bucket as the 8-bit codes are."""
    s = np.float32(levels)
    if bits < 8:
        codes = np.empty(_CHUNK, np.uint8)
        words = np.empty(_CHUNK // 8, np.uint64)
        total_bytes = (count * bits + 7) // 8
        for c0 in range(0, count, _CHUNK):
            c1 = min(c0 + _CHUNK, count)
            _unpack_small(data, c0 * bits // 8, total_bytes, bits, (c1 - c0 + 7) // 8, words, codes)
            i = c0
            while i < c1:
                stop = min(c1, (i // bucket + 1) * bucket)
                step = scales[i // bucket] / s
                cs, values = codes[i - c0:stop - c0], out[i:stop]
                for t in range(stop - i):
                    values[t] = (np.float32(cs[t]) - s) * step
                i = stop
        return
    if bits == 8:                          # a code per byte: bucket by bucket, vectorised
        for b in range((count + bucket - 1) // bucket):
            lo, hi = b * bucket, min(count, (b + 1) * bucket)
            step = scales[b] / s
            codes, values = data[lo:hi], out[lo:hi]
            for t in range(hi - lo):
                values[t] = (np.float32(codes[t]) - s) * step
        return
    mask = np.uint64((1 << bits) - 1)
    step = np.float32(0)
    for g in range((count + 7) // 8):
        first = g * bits                   # 8 codes of ``bits`` bits: ``bits`` bytes
        nbytes = min(bits, (count * bits + 7) // 8 - first)
        low = np.uint64(0)
        high = np.uint64(0)
        for q in range(nbytes):
            byte = np.uint64(data[first + q])
            if q < 8:
                low |= byte << np.uint64(8 * q)
            else:
                high |= byte << np.uint64(8 * (q - 8))
        lanes = min(8, count - 8 * g)
        for k in range(lanes):
            i = 8 * g + k
            if i % bucket == 0 or k == 0:
                step = scales[i // bucket] / s
            shift = k * bits
            if shift + bits <= 64:
                code = (low >> np.uint64(shift)) & mask
            elif shift >= 64:
                code = (high >> np.uint64(shift - 64)) & mask
            else:
                code = ((low >> np.uint64(shift)) | (high << np.uint64(64 - shift))) & mask
            out[i] = (np.float32(code) - s) * step


# ------------------------------------------------------------- 1 bit over buckets
@jit
def bucket_one_bit_encode(x, bucket, tiny, means, out, decoded, residual, sides):
    """:class:`~horovod_sparse.quantize.onebit_buckets.BucketedOneBitCodec`'s code of x, bucket by
    bucket while it is in L1: each side's values (x, or 0 beyond +-``tiny`` on the other side; a
    NaN on both) summed in the tree order of :mod:`horovod_sparse.quantize.sums`, over the side's
    count, a mean below ``tiny`` 0, into ``means`` ([pos, neg] per bucket); the bits (1 where
    x <= -tiny) into ``out`` (zeroed here); ``decoded`` / ``residual`` (if not empty) the bucket's
    mean and x minus it. ``sides``: float32 (2, bucket) scratch.

    Replaces the codec's numpy passes (two selects, a concatenation, log2(bucket) tree rounds,
    the counts, a select per value for the decoded floats, the bits and their packing)."""
    n = x.shape[0]
    want_decoded, want_residual = decoded.shape[0] > 0, residual.shape[0] > 0
    for q in range((n + 7) // 8):
        out[q] = 0
    for k, b0 in enumerate(range(0, n, bucket)):
        width = min(bucket, n - b0)
        xs = x[b0:b0 + width]
        pos, neg = sides[0], sides[1]
        negatives = 0
        for i in range(width):
            v = xs[i]
            pos[i] = np.float32(0) if v < tiny else v
            neg[i] = np.float32(0) if v > -tiny else v
            if v <= -tiny:
                negatives += 1
        p = _rounds(pos, width) / np.float32(max(width - negatives, 1))
        m = _rounds(neg, width) / np.float32(max(negatives, 1))
        p = np.float32(0) if abs(p) < tiny else p
        m = np.float32(0) if abs(m) < tiny else m
        means[2 * k], means[2 * k + 1] = p, m
        if b0 % 64:                                  # a bucket not on a word of bits: value by value
            for i in range(width):
                if xs[i] <= -tiny:
                    out[(b0 + i) >> 3] |= np.uint8(1 << ((b0 + i) & 7))
        else:
            for w0 in range(0, width, 64):           # 64 values a word
                lanes = min(64, width - w0)
                mask = np.uint64(0)
                for b in range(lanes):
                    if xs[w0 + b] <= -tiny:
                        mask |= np.uint64(1) << np.uint64(b)
                o = out[(b0 + w0) >> 3:((b0 + w0) >> 3) + (lanes + 7) // 8]
                for q in range((lanes + 7) // 8):
                    o[q] = np.uint8((mask >> np.uint64(8 * q)) & np.uint64(0xFF))
        if want_decoded:
            ds = decoded[b0:b0 + width]
            for i in range(width):
                ds[i] = m if xs[i] <= -tiny else p
        if want_residual:                            # after decoded: residual may be x itself
            rs = residual[b0:b0 + width]
            for i in range(width):
                rs[i] = xs[i] - (m if xs[i] <= -tiny else p)


@jit
def bucket_one_bit_decode(data, count, bucket, means, out):
    """out[i] = means[2 k + bit i] for value i of bucket k, the first ``count`` bits of ``data``
    (LSB first): :class:`~horovod_sparse.quantize.onebit_buckets.BucketedOneBitCodec`'s decode."""
    for k, b0 in enumerate(range(0, count, bucket)):
        p, m = means[2 * k], means[2 * k + 1]
        end = min(b0 + bucket, count)
        if b0 % 64:                                  # a bucket not on a word of bits: value by value
            for i in range(b0, end):
                out[i] = m if (data[i >> 3] >> (i & 7)) & 1 else p
            continue
        for w0 in range(b0, end, 64):                # 64 values a word: the select loop vectorises
            lanes = min(64, end - w0)
            word = _word(data, w0, lanes)
            os = out[w0:w0 + lanes]
            for b in range(lanes):
                os[b] = m if (word >> np.uint64(b)) & np.uint64(1) else p
