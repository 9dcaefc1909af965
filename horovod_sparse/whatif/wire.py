"""What each compressor puts on the wire, per rank and step, from its parameters: formulas
per family, used when no measurement at that P exists (a profile runs at P = 1, where
nothing moves).

Two kinds of compressor:

* carried by Horovod's allreduce (``dense``/``none``, ``fp16``, ``hvd-fp16``, ``randomk``):
  each gradient becomes a smaller dense payload that Horovod fuses into buckets and
  ring-allreduces, 2(P-1)/P x payload bytes per rank in 2(P-1) rounds;
  :func:`payload_bytes` gives each gradient's payload;
* out-of-band (everything else): one exchange of the whole flattened buffer after backward, by
  the package's own engine; :func:`fused_exchange` gives (bytes sent per rank, message
  rounds). Formulas, with n elements, k = ceil(density * n) (or the measured fraction),
  index+value pairs of 8 bytes (int32 indices below 2**31 elements):

  - top-k family, ``allgather`` (TopkA): (P-1) * 8k in P-1 rounds;
  - ``oktopk``: about 2(P-1)/P * 8k (measured here 1.00-1.01x of it at P = 2..4; the
    paper's bound is < 6k pairs);
  - ``gtopk``: ceil(log2 P) * 8k + 4k (tree merge, then broadcast of values);
  - ``dsa``: 8k(P-1)/P to the region owners, then each region (u/P nonzeros of the
    union u = n(1 - (1 - k/n)^P), dense when cheaper) to the P-1 others;
  - quantizers: their codec's exact code size c(n); ``alltoall`` 2(P-1)/P * c(n),
    ``allgather`` (P-1) * c(n);
  - ``powersgd``: 2 allreduces of P and Q, 2(P-1)/P * 4 * (sum r(a+b) over compressed
    matrices + elements of the others);
  - ``fft``: (1 - theta) of the (chunk + 2) real spectrum values per chunk, each a 4-byte
    position and a ``bits``-bit code, allgathered ((P-1) x) or by Ok-Topk.

    >>> round(payload_ratio("fp16"), 2), carrier("topk:density=0.01")
    (0.5, 'out_of_band')
    >>> fused_exchange("topk:density=0.01", n=1_000_000, workers=4)   # (P-1) * 8k bytes, P-1 rounds
    (240000.0, 3)
"""
import math

#: The step benchmark's names for Horovod's own compressors, and what they are.
HOROVOD_NAMES = {"dense": "none", "hvd-none": "none", "hvd-fp16": "fp16"}
#: Horovod carriers: bytes of payload per byte of float32 gradient.
_HOROVOD_RATIO = {"none": 1.0, "fp16": 0.5}
#: The probe each out-of-band compressor hands Horovod per gradient (one float32).
PROBE_BYTES = 4


def parse(spec):
    """``(name, compressor object or None)``: the registry's compressor for a spec, None for
    Horovod's own (``dense``, ``hvd-fp16``)."""
    if spec in HOROVOD_NAMES:
        return spec, None
    import horovod_sparse
    obj = horovod_sparse.create(spec)
    return obj.name, obj


def canonical(spec):
    """A spec with every parameter spelled out, so that ``topk`` and
    ``topk:density=0.01`` compare equal; Horovod's ``dense``/``hvd-none`` are ``none``."""
    if spec in HOROVOD_NAMES:
        return HOROVOD_NAMES[spec] if HOROVOD_NAMES[spec] == "none" else spec
    try:
        return parse(spec)[1].spec
    except ValueError:
        return spec


def carrier(spec):
    """"horovod" or "out_of_band"."""
    name, obj = parse(spec)
    if obj is None:
        return "horovod"
    return "out_of_band" if getattr(obj, "out_of_band", False) else "horovod"


def payload_ratio(spec, elements=None):
    """Payload bytes per gradient byte for a Horovod carrier (randomk: k/n of a tensor of
    ``elements`` elements, ``density`` when not given)."""
    name, obj = parse(spec)
    base = HOROVOD_NAMES.get(name, name)
    if base in _HOROVOD_RATIO:
        return _HOROVOD_RATIO[base]
    if name == "randomk":
        if not elements:
            return obj.density
        return obj.k_for(elements) / elements
    raise ValueError(f"{spec!r} is not carried by Horovod's allreduce")


def dense_below():
    """Out-of-band compressors send gradients with fewer elements through Horovod, unchanged."""
    from horovod_sparse.out_of_band import DEFAULT_DENSE_BELOW
    return DEFAULT_DENSE_BELOW


def out_of_band_part(gradients):
    """The gradients an out-of-band compressor flattens into its buffer (the others go dense)."""
    limit = dense_below()
    return [g for g in gradients if g.nbytes // 4 >= limit]


def payload_bytes(spec, gradients):
    """Per gradient: what Horovod allreduces for it (for an out-of-band compressor: a one-float
    probe, or the whole gradient when it is too small to be fused)."""
    if carrier(spec) == "out_of_band":
        limit = dense_below()
        return [PROBE_BYTES if g.nbytes // 4 >= limit else g.nbytes for g in gradients]
    out = []
    for g in gradients:
        elements = max(1, g.nbytes // 4)
        out.append(g.nbytes * payload_ratio(spec, elements))
    return out


def _index_bytes(n):
    return 4 if n < 2 ** 31 else 8


def _sparse(exchange, n, k, workers):
    pair = _index_bytes(n) + 4
    p = workers
    if exchange == "allgather":
        return float((p - 1) * pair * k), p - 1
    if exchange == "oktopk":
        return 2.0 * (p - 1) / p * pair * k, 2 * (p - 1)
    if exchange == "gtopk":
        levels = math.ceil(math.log2(p))
        return levels * pair * k + 4.0 * k, 2 * levels
    if exchange == "dsa":
        union = n * (1.0 - (1.0 - min(1.0, k / n)) ** p)
        region = min(pair * union / p, 4.0 * n / p)
        return pair * k * (p - 1) / p + (p - 1) * region, 2 * (p - 1)
    raise ValueError(f"unknown exchange {exchange!r}")


def _powersgd_elements(obj, shapes, n):
    if not shapes:   # a plain buffer: one zero-padded near-square matrix
        side = math.ceil(math.sqrt(n))
        shapes = [(side, side)]
    total = 0
    for shape in shapes:
        size = math.prod(shape) if shape else 1
        if len(shape) >= 2:
            a, b = shape[0], size // shape[0]
            r = min(obj.rank, a, b)
            if a * b >= obj.min_compression_rate * r * (a + b):
                total += r * (a + b)
                continue
        total += size
    return total


def fused_exchange(spec, n, workers, shapes=None, sent_fraction=None):
    """``(bytes sent per rank, message rounds)`` of an out-of-band compressor's exchange of an
    ``n``-element float32 buffer on ``workers`` ranks (formulas of the module docstring).
    ``shapes`` (the gradients' shapes) matter to PowerSGD; ``sent_fraction`` replaces the
    nominal density where the count depends on the data (threshold, DGC, Gaussiank)."""
    name, obj = parse(spec)
    if workers <= 1 or n <= 0:
        return 0.0, 0
    p = workers
    if hasattr(obj, "codec") and hasattr(obj, "method"):     # quantizers
        try:
            code = obj.codec().nbytes(n)
        except Exception:   # a codec without exact sizes: its bits per value
            code = n * 4
        if obj.method == "allgather":
            return float((p - 1) * code), p - 1
        return 2.0 * (p - 1) / p * code, 2 * (p - 1)
    if name == "powersgd":
        return 2.0 * (p - 1) / p * 4 * _powersgd_elements(obj, shapes, n), 4 * (p - 1)
    if name == "fft":
        kept = (1.0 - obj.theta) * n * (obj.chunk_size + 2) / obj.chunk_size
        if obj.exchange == "allgather":
            return (p - 1) * kept * (_index_bytes(n) + obj.bits / 8.0), p - 1
        return _sparse("oktopk", n, kept, p)
    if hasattr(obj, "k_for"):   # sparsifiers
        if sent_fraction is not None:
            k = sent_fraction * n
        elif getattr(obj, "density", None) is not None:
            k = obj.k_for(n)
        else:   # a threshold without a measured count: assume it sends everything
            k = n
        exchange = getattr(obj, "exchange", None) or {"oktopk": "oktopk", "gtopk": "gtopk"}.get(name, "allgather")
        return _sparse(exchange, n, k, p)
    return 2.0 * (p - 1) / p * 4 * n, 2 * (p - 1)   # unknown: as much as dense


def bytes_per_value(spec, n):
    """Bytes on the wire per gradient value an out-of-band compressor sends: an index+value pair
    for the sparsifiers, the code size per element for the quantizers, 4 for PowerSGD's
    factors, a position and a ``bits``-bit code for FFT."""
    name, obj = parse(spec)
    if hasattr(obj, "codec") and hasattr(obj, "method"):
        try:
            return obj.codec().nbytes(n) / n
        except Exception:   # a codec without exact sizes (as fused_exchange)
            return 4.0
    if name == "fft":
        return _index_bytes(n) + obj.bits / 8.0
    if hasattr(obj, "k_for"):
        return _index_bytes(n) + 4.0
    return 4.0


def received_values(spec, n, wire_bytes):
    """Values a rank adds into its result from the other ranks in a fused exchange of
    ``wire_bytes`` per rank: it receives as much as it sends, so (P-1) payloads for an
    allgather, 2(P-1)/P of the buffer for a reduce-scatter + allgather.

    >>> received_values("topk:density=0.01", 1_000_000, 240000.0)   # P = 4: (P-1) k
    30000.0
    """
    return wire_bytes / bytes_per_value(spec, n) if n > 0 else 0.0


def dense_ring_bytes(nbytes, workers):
    """Bytes a rank sends in a ring allreduce of ``nbytes``: 2(P-1)/P of them."""
    return 0.0 if workers <= 1 else 2.0 * (workers - 1) / workers * nbytes
