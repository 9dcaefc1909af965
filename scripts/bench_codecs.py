#!/usr/bin/env python3
"""Throughput of every compressor's compress + decompress, PyTorch and TensorFlow side by side.

What a rank pays locally per step, whatever the network: one 25M-element float32
gradient (100 MB, shaped 5000 x 5000 so PowerSGD has a matrix) goes through the
frontend's ``compress`` then ``decompress``, exactly as Horovod calls them, in one
process (P = 1). For the fused compressors (sparsifiers, quantizers, PowerSGD, FFT)
that includes the pipeline's whole local work: error feedback, selection or
encoding, the exchange with itself (no bytes move at P = 1), decoding, the residual
update and the conversions between the framework and numpy. TensorFlow runs inside a
``tf.function``, as Horovod calls it.

Per compressor and framework: ``--warmup`` untimed calls, then ``--repeats`` timed
ones; the table gives the median time and GB/s of gradient (bytes in / median time).

    .venv/bin/python scripts/bench_codecs.py --update-md docs/benchmarks.md
"""
import argparse
import json
import os
import platform
import re
import statistics
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

SPECS = ["none", "fp16", "randomk:density=0.01", "topk:density=0.01", "oktopk:density=0.01",
         "gtopk:density=0.01", "gaussiank:density=0.01", "dgc:density=0.01", "bf16", "qsgd", "terngrad",
         "signsgd", "signum", "efsignsgd", "onebit", "powersgd", "fft"]
BEGIN, END = "<!-- throughput:begin -->", "<!-- throughput:end -->"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=5000, help="gradient rows (elements = rows x cols)")
    p.add_argument("--cols", type=int, default=5000, help="gradient columns")
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--frameworks", nargs="+", default=["torch", "tensorflow"], choices=["torch", "tensorflow"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", help="append one JSON line per measurement")
    p.add_argument("--update-md", help="replace the throughput section of this markdown file")
    return p.parse_args()


def fused_params(spec):
    """The fused compressors' small-tensor policy does not apply to one big gradient anyway."""
    import horovod_sparse
    return {"dense_below": 0} if getattr(horovod_sparse.create(spec), "fused", False) else {}


def torch_round_trip(spec, gradient):
    import torch
    import horovod_sparse.torch as hvds
    compressor = hvds.Compression.from_spec(spec, **fused_params(spec))
    tensor = torch.from_numpy(gradient)

    def run():
        payload, ctx = compressor.compress(tensor)
        return compressor.decompress(payload, ctx)  # at P = 1 the reduced payload is the payload
    return run


def tensorflow_round_trip(spec, gradient):
    import tensorflow as tf
    import horovod_sparse.tensorflow as hvds
    compressor = hvds.Compression.from_spec(spec, **fused_params(spec))
    tensor = tf.constant(gradient)

    @tf.function
    def round_trip(t):
        payload, ctx = compressor.compress(t)
        return compressor.decompress(payload, ctx)

    return lambda: round_trip(tensor).numpy()


def measure(make, spec, gradient, args):
    run = make(spec, gradient)
    for _ in range(args.warmup):
        run()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def markdown(records, args):
    n = args.rows * args.cols
    by = {(r["spec"], r["framework"]): r for r in records}
    lines = [f"Compress + decompress of one {n / 1e6:.0f}M-element float32 gradient ({n * 4 / 1e6:.0f} MB) "
             f"through each frontend at P = 1, median of {args.repeats} after {args.warmup} warm-up; "
             f"{platform.node()}, {os.cpu_count()} cores, no GPU, shared with other jobs. Command: "
             f"`.venv/bin/python scripts/bench_codecs.py --update-md docs/benchmarks.md`.", "",
             "| compressor | torch s | torch GB/s | TensorFlow s | TensorFlow GB/s |", "|---|---:|---:|---:|---:|"]
    for spec in args.specs:
        cells = []
        for fw in ("torch", "tensorflow"):
            r = by.get((spec, fw))
            cells += [f"{r['median_s']:.3f}", f"{r['gb_per_s']:.2f}"] if r else ["-", "-"]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main():
    args = parse_args()
    from mpi4py import MPI  # noqa: F401  (initialises MPI before the frameworks' Horovod)
    import horovod.torch as hvd_torch
    hvd_torch.init()
    gradient = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    makers = {"torch": torch_round_trip, "tensorflow": tensorflow_round_trip}
    records = []
    for spec in args.specs:
        for fw in args.frameworks:
            times = measure(makers[fw], spec, gradient, args)
            median = statistics.median(times)
            rec = dict(spec=spec, framework=fw, n=int(gradient.size), median_s=median, min_s=min(times),
                       max_s=max(times), gb_per_s=gradient.nbytes / median / 1e9, repeats=args.repeats)
            records.append(rec)
            print(f"{spec:24s} {fw:10s} median {median:.3f} s  {rec['gb_per_s']:.2f} GB/s", flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
    table = markdown(records, args)
    print(table)
    if args.update_md:
        with open(args.update_md) as f:
            text = f.read()
        section = f"{BEGIN}\n{table}{END}"
        if BEGIN in text:
            text = re.sub(re.escape(BEGIN) + ".*?" + re.escape(END), lambda _: section, text, flags=re.S)
        else:
            text += "\n## Compress + decompress throughput\n\n" + section + "\n"
        with open(args.update_md, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
