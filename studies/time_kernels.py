"""The quantizers' and Ok-Topk's compiled kernels timed alone, beside a memory copy (docs/results/
benchmarks.md, "The quantizers' passes"): on 25M standard normal float32 values, one thread,
median of 7 after one warm-up call, the kernels of whatever ``horovod_sparse`` is imported:

- the sign encode (code, decoded floats and residual; code alone);
- TernGrad's scale, max |x|;
- QSGD's (16 levels, 6 bits; and 127 levels, a byte) and TernGrad's encode (code and decoded
  floats, as at P = 1) and decode, through the codecs (packing and unpacking included);
- which of 250,000 sorted indices are in another sorted set (``isin_sorted``);
- a write pass into reused memory and into fresh memory (numpy's and torch's allocators).

Its output at two commits is in docs/results/data/codecs/time-kernels.txt; at 43aad3e and
b088b78 (the narrow levels' packing), three times each alternately, in time-kernels-1128.txt.

Run it at two commits to compare them (the kernels' signatures are the same in both)::

    .venv/bin/python studies/time_kernels.py
    git worktree add /tmp/before 1212da2 && PYTHONPATH=/tmp/before .venv/bin/python studies/time_kernels.py
"""
import statistics
import time

import numpy as np
import torch

import horovod_sparse
from horovod_sparse.ops.cpu import quantize as fused
from horovod_sparse.ops.indices import isin_sorted
from horovod_sparse.quantize.codecs import QSGDCodec, TernGradCodec

N = 25_000_000


def median_ms(run, repeats=7):
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(N).astype(np.float32)
    decoded, residual, target = (np.empty(N, np.float32) for _ in range(3))
    code, values, none = np.empty((N + 7) // 8, np.uint8), np.float32([0.7, -0.7]), np.empty(0, np.float32)
    scale = np.empty(1, np.float32)
    local = np.unique(rng.integers(0, N, 260_000))
    chosen = np.union1d(np.unique(rng.integers(0, N, 250_000)), local[::2])
    rows = [
        ("memory copy", lambda: np.copyto(target, x)),
        ("write into reused memory", lambda: target.fill(1.0)),
        ("write into fresh memory (numpy)", lambda: np.empty(N, np.float32).fill(1.0)),
        ("write into fresh memory (torch)", lambda: torch.empty(N).fill_(1.0)),
        ("sign encode: code, decoded, residual", lambda: fused.sign_encode(x, code, values, decoded, residual)),
        ("sign encode: code alone", lambda: fused.sign_encode(x, code, values, none, none)),
        ("TernGrad's scale, max |x|", lambda: fused.max_magnitude(x, scale)),
        (f"isin_sorted, {local.size} in {chosen.size}", lambda: isin_sorted(local, chosen)),
    ]
    for name, codec in [("QSGD 16 levels", QSGDCodec()), ("QSGD 127 levels", QSGDCodec(levels=127)),
                        ("TernGrad", TernGradCodec())]:
        packed = np.empty(codec.nbytes(N), np.uint8)
        rows += [(f"{name}: encode, code and decoded", lambda c=codec, p=packed: c.encode(x, 7, p, decoded)),
                 (f"{name}: decode", lambda c=codec, p=packed: c.decode(p, N, out=target))]
    print(f"horovod_sparse from {horovod_sparse.__file__}; {N} float32 values, median of 7")
    for name, run in rows:
        print(f"{name:42s} {median_ms(run):7.1f} ms")


if __name__ == "__main__":
    main()
