"""Should 1-bit SGD's two means be per bucket, and of how many values? The relative error per
value ||decode(encode(x)) - x|| / ||x|| of one encode, and the bits per value the code sends
(the means included), for the paper's code (two means per encoded vector) and for buckets of
32 to 2048 values.

The vector: the byte transformer's gradient at initialisation (horovod_sparse.workloads.stdlib_lm,
one batch of 4 windows, seed 0), its tensors flattened in order, at the study's size (4 layers
of 256, 3.3M values) and at the workload's full size (6 of 512, 19.2M), cut in two as the
compressed allreduce cuts it at P = 2 (each rank's code of each chunk; a bucketed code's chunks
start at a bucket's start, ``chunk_unit``), and, for the study's size, also cut at n // 2 (half
a row of 256 off: what a chunk starting mid-row costs). The codes are deterministic: no seed.

    .venv/bin/python studies/onebit_buckets_error.py > docs/results/data/codecs/onebit-buckets-error.md

Output: a markdown table, quoted in docs/quantizers.md (the 1-bit section).
"""
import sys

import numpy as np

from horovod_sparse.quantize.codecs import OneBitCodec
from horovod_sparse.quantize.onebit_buckets import BucketedOneBitCodec

BUCKETS = (32, 64, 128, 256, 512, 2048)
SIZES = {"study, 4 x 256": dict(layers=4, d_model=256, heads=4), "full, 6 x 512": {}}


def lm_gradient(size):
    import torch
    from horovod_sparse.workloads import stdlib_lm
    model = stdlib_lm.build_model(seed=0, **size)
    stdlib_lm.loss(model, next(stdlib_lm.batches(0, 1))).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


def relative_error(codec, x, unit=None):
    """Over the two chunks, each encoded on its own; cut where the compressed allreduce cuts
    at P = 2 (``unit`` None: the codec's chunk_unit), or at a multiple of ``unit``."""
    unit = codec.chunk_unit if unit is None else unit
    middle = x.size // unit // 2 * unit
    error = sum(float(np.sum((codec.roundtrip(h).astype(np.float64) - h) ** 2)) for h in (x[:middle], x[middle:]))
    return (error / float(np.sum(x.astype(np.float64) ** 2))) ** 0.5


def main():
    vectors = {name: lm_gradient(size) for name, size in SIZES.items()}
    study = next(iter(vectors.values()))
    codecs = [("per vector (the paper's)", OneBitCodec())] + [(str(b), BucketedOneBitCodec(b)) for b in BUCKETS]
    print("| bucket | bits per value | " + " | ".join(f"error, {name}" for name in vectors)
          + " | error, study, cut at n // 2 |")
    print("|---|---:|" + "---:|" * (len(vectors) + 1))
    for name, codec in codecs:
        per_value = 8 * codec.nbytes(1 << 20) / (1 << 20)
        errors = " | ".join(f"{relative_error(codec, x):.3f}" for x in vectors.values())
        print(f"| {name} | {per_value:.3f} | {errors} | {relative_error(codec, study, unit=1):.3f} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
