"""What the sparsifiers' indexed loads and stores and their k-th keys cost (docs/results/
benchmarks.md, "The selected entries' loads and stores, compiled"):

- the zeroing of top-k's residual at its selected entries (1% of 25M), timed around each call
  inside the PyTorch round trip of ``scripts/bench_codecs.py`` (where the lines are not cached),
  with the package's ``ops.kernels.zero_at`` (the compiled loop on the CPU) and with torch's
  ``index_fill_``, and the same two in a loop that zeroes the same entries again (where they are);
- two k-th largest keys of 375,000 int32 candidate keys: one ``np.partition`` at two positions,
  two partitions at one position each, and ``ops.magnitude.kth_largests``;
- where top-k's whole round trip goes: ``cProfile`` of 5 round trips, the functions that take
  the most time of their own, per call, beside a memory copy of the gradient.

Medians over the timed calls, one thread. Its output is in docs/results/data/codecs/time-indexed.txt::

    .venv/bin/python studies/time_indexed.py
"""
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")  # the steady codec
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import bench_codecs  # noqa: E402
import horovod_sparse.memory as memory  # noqa: E402
from horovod_sparse.ops import kernels  # noqa: E402
from horovod_sparse.ops.magnitude import kth_largests  # noqa: E402

N, DENSITY = 25_000_000, 0.01


def residual_zeroing_in_the_round_trip(zero, calls=7):
    """Milliseconds of each residual zeroing in top-k's round trip, ``zero`` doing it."""
    spent, kept = [], memory.zero_at

    def timed(x, indices):
        start = time.perf_counter()
        out = zero(x, indices)
        spent.append(time.perf_counter() - start)
        return out

    memory.zero_at = timed
    try:
        gradient = np.random.default_rng(0).standard_normal((5000, 5000)).astype(np.float32)
        prepare, run = bench_codecs.torch_round_trip(f"topk:density={DENSITY}", gradient)
        for _ in range(2 + calls):
            prepare()
            run()
    finally:
        memory.zero_at = kept
    return 1e3 * statistics.median(spent[2:])


def median_ms(run, prepare=lambda: None, repeats=21):
    times = []
    for _ in range(repeats):
        prepare()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def round_trip_profile(rows=10, calls=5):
    """The round trip's ``rows`` most expensive functions (their own time, ms per round trip)."""
    gradient = np.random.default_rng(0).standard_normal((5000, 5000)).astype(np.float32)
    prepare, run = bench_codecs.torch_round_trip(f"topk:density={DENSITY}", gradient)
    for _ in range(3):
        prepare()
        run()
    source, target = torch.from_numpy(gradient), torch.empty(gradient.shape)
    copy = median_ms(lambda: target.copy_(source), repeats=7)
    whole = median_ms(run, prepare, repeats=7)
    profile = cProfile.Profile()
    for _ in range(calls):
        prepare()
        profile.enable()
        run()
        profile.disable()
    stats = pstats.Stats(profile, stream=io.StringIO()).stats
    own = sorted(((tottime, f"{os.path.basename(path)}:{name}" if path != "~" else name)
                  for (path, _, name), (_, _, tottime, _, _) in stats.items()), reverse=True)
    print(f"top-k's round trip: {whole:.1f} ms (median of 7), a copy of the gradient {copy:.1f} ms; "
          f"own time per round trip (cProfile of {calls}):")
    for tottime, name in own[:rows]:
        print(f"  {1e3 * tottime / calls:6.2f}  {name}")


def index_fill(x, indices):
    return x.index_fill_(0, indices, 0)


def main():
    torch.set_num_threads(1)
    print(f"residual zeroing in top-k's round trip ({N} float32, density {DENSITY}), ms per call:")
    print(f"  compiled loop (ops.kernels.zero_at)  {residual_zeroing_in_the_round_trip(kernels.zero_at):6.2f}")
    print(f"  torch index_fill_                    {residual_zeroing_in_the_round_trip(index_fill):6.2f}")
    rng = np.random.default_rng(1)
    x = torch.randn(N)
    indices = torch.from_numpy(np.sort(rng.choice(N, int(DENSITY * N), replace=False)))
    print("the same entries zeroed again and again (their lines cached), ms per call:")
    print(f"  compiled loop (ops.kernels.zero_at)  {median_ms(lambda: kernels.zero_at(x, indices)):6.2f}")
    print(f"  torch index_fill_                    {median_ms(lambda: index_fill(x, indices)):6.2f}")
    size, ks = 375_000, (62_500, 93_750)
    keys = {}

    def draw():
        keys["x"] = rng.standard_normal(size).astype(np.float32).view(np.int32) & 0x7FFFFFFF

    print(f"two k-th largest of {size} int32 keys (k = {ks[0]}, {ks[1]}), ms per call:")
    print(f"  np.partition at two positions        "
          f"{median_ms(lambda: np.partition(keys['x'], [size - k for k in ks]), draw):6.2f}")
    print(f"  np.partition at one position, twice  "
          f"{median_ms(lambda: [np.partition(keys['x'], size - k) for k in ks], draw):6.2f}")
    print(f"  ops.magnitude.kth_largests           {median_ms(lambda: kth_largests(keys['x'], ks), draw):6.2f}")
    round_trip_profile()


if __name__ == "__main__":
    main()
