"""Which bucket size should int4 use, and how much less error does it make than qsgd at the same
bits? The relative error per value ||decode(encode(x)) - x|| / ||x|| of one encode, and the bytes
per value the code sends (scales included), for int4 at 2, 3 and 4 bits and buckets of 32 to 512
values, beside qsgd at the same bits (levels 1, 3, 7: 2, 3, 4 bits; 15: 5 bits) and at 8 bits
(127 levels), at its default bucket (512) and at 128.

Two vectors: ``synthetic``, 2**20 float32 values N(0, 1e-3) of which 0.1% (chosen at random)
are N(0, 5e-2) outliers; ``stdlib_lm``, the byte transformer's gradient at initialisation
(horovod_sparse.workloads.stdlib_lm, full size, 19.2M values: one batch of 4 windows, seed 0),
the 78 tensors flattened in order. qsgd is stochastic: its error is one seed's (0); int4 has
no seed.

    .venv/bin/python studies/int4_error.py > docs/results/data/codecs/int4-error.md

Output: a markdown table, quoted in docs/quantizers.md (the int4 section).
"""
import sys

import numpy as np

from horovod_sparse.quantize.absmax import Int4Codec
from horovod_sparse.quantize.codecs import QSGDCodec

BUCKETS = (32, 64, 128, 256, 512)


def synthetic(count=1 << 20, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1e-3, count)
    outliers = rng.choice(count, count // 1000, replace=False)
    x[outliers] = rng.normal(0, 5e-2, outliers.size)
    return x.astype(np.float32)


def lm_gradient():
    from horovod_sparse.workloads import stdlib_lm
    import torch
    model = stdlib_lm.build_model(seed=0)
    stdlib_lm.loss(model, next(stdlib_lm.batches(0, 1))).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy()


def relative_error(codec, x):
    error = codec.roundtrip(x, seed=0).astype(np.float64) - x
    return float(np.linalg.norm(error) / np.linalg.norm(x.astype(np.float64)))


def codecs():
    for bits in (4, 3, 2):
        for bucket in BUCKETS:
            yield "int4", bits, Int4Codec(bits, bucket)
    for levels in (127, 15, 7, 3, 1):
        for bucket in (128, 512):
            codec = QSGDCodec(levels, bucket)
            yield f"qsgd levels={levels}", codec.bits, codec


def main():
    vectors = {"synthetic": synthetic(), "stdlib_lm": lm_gradient()}
    print("| code | bits | bucket | bytes per value | " + " | ".join(f"error, {v}" for v in vectors) + " |")
    print("|---|---:|---:|---:|" + "---:|" * len(vectors))
    for name, bits, codec in codecs():
        per_value = codec.nbytes(1 << 20) / (1 << 20)
        errors = " | ".join(f"{relative_error(codec, x):.4f}" for x in vectors.values())
        print(f"| {name} | {bits} | {codec.bucket_size} | {per_value:.4f} | {errors} |")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
