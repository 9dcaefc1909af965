#!/usr/bin/env python3
"""Throughput of every compressor's compress + decompress, beside a plain memory copy.

What a rank pays locally per step, whatever the network: one 25M-element float32
gradient (100 MB, shaped 5000 x 5000 so PowerSGD has a matrix) goes through the
frontend's ``compress`` then ``decompress``, exactly as Horovod calls them, in one
process (P = 1, one thread by default). For the out-of-band compressors (sparsifiers,
quantizers, PowerSGD, FFT) that includes the pipeline's whole local work: fusing the
gradient, error feedback, selection or encoding, the exchange with itself (no bytes
move at P = 1), decoding, the residual update and writing the result into the gradient.
TensorFlow (``--frameworks tensorflow``) runs inside a ``tf.function``, as Horovod calls it.

Per compressor and framework: ``--warmup`` untimed calls, then ``--repeats`` timed ones,
each on a new gradient drawn untimed (standard normal, like a training step's, whose
error-feedback residual settles instead of growing with one gradient repeated; the
out-of-band compressors also write their result into the gradient tensor, as Horovod's
in-place allreduce does). ``--same-gradient`` repeats one gradient instead.
``horovod-fp16`` (and ``horovod-none``) is Horovod's own ``hvd.Compression.fp16``, measured beside ours.
The table gives the median time and GB/s of gradient (bytes in / median time), and a
``dst.copy_(src)`` of the same buffer measured in the same run: the memory bound; and the
overflow check alone (``horovod_sparse.ops.finite.all_finite``), which every stateful
compressor's round trip includes.

On a GPU, ``--device cuda`` times the out-of-band pipelines' step on a CUDA tensor: the code the
PyTorch frontend runs there (error feedback, selection or encoding, decoding, the residual, the
sum written back into the gradient), without Horovod's hooks, so Horovod need not be built with
CUDA; the in-band compressors and Horovod's own go through the frontend only where Horovod is
importable. Each call ends with ``torch.cuda.synchronize()``; the copy bound is a device copy.

``--count`` (at least 2 ranks: ``mpirun -np 2``) counts instead of timing (docs/cuda.md, "Counted on the CPU"): per
out-of-band compressor, one steady training step through the stock ``hvd.DistributedOptimizer``
under the device path (``HOROVOD_SPARSE_KERNELS=torch``: CPU tensors run the ops a CUDA tensor
runs), at ``--count-tensors`` gradients of 32 x 32 floats each: the aten ops, host
synchronisations and host transfers of ``compress`` + exchange + ``decompress`` on rank 0, and
their growth per additional gradient (:mod:`horovod_sparse.bench.counts`). With
``HOROVOD_SPARSE_DEVICE_BUFFERS=on`` the payloads go to MPI as device buffers where the exchange
allows (what an MPI with CUDA support gets on a GPU): the last column counts them.

``--sync-count`` counts one P = 1 step of each out-of-band pipeline on ``--device`` (no Horovod:
a GPU image without it, or one GPU): the same counts, and on CUDA the synchronising calls torch
itself reports under ``torch.cuda.set_sync_debug_mode("warn")``.

    .venv/bin/python scripts/bench_codecs.py --json results/codecs.json
    mpirun -np 2 .venv/bin/python scripts/bench_codecs.py --count
    HOROVOD_SPARSE_DEVICE_BUFFERS=on mpirun -np 2 .venv/bin/python scripts/bench_codecs.py --count
    python3 scripts/bench_codecs.py --device cuda --sync-count        # scripts/cuda_check.sh
    .venv/bin/python scripts/bench_codecs.py --frameworks torch tensorflow --update-md docs/results/benchmarks.md
    python3 scripts/bench_codecs.py --device cuda --json $OUT/codecs-cuda.json      # scripts/cuda_check.sh
"""
import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")  # the steady codec, not a warm-up's dense steps

import numpy as np  # noqa: E402

from doc_block import replace_block  # noqa: E402  (scripts/, beside this file)

SPECS = ["none", "fp16", "randomk:density=0.01", "topk:density=0.01", "oktopk:density=0.01",
         "gtopk:density=0.01", "gaussiank:density=0.01", "dgc:density=0.01", "threshold:value=2.6",
         "bf16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit", "powersgd", "fft"]
#: Horovod's own compressors, measured beside ours: spec name -> attribute of hvd.Compression
HOROVOD = {"horovod-fp16": "fp16", "horovod-none": "none"}
COPY = "memory copy"
#: the overflow check every stateful pipeline makes on what it compresses (horovod_sparse.ops.finite)
CHECK = "overflow check"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=5000, help="gradient rows (elements = rows x cols)")
    p.add_argument("--cols", type=int, default=5000, help="gradient columns")
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--frameworks", nargs="+", default=["torch"], choices=["torch", "tensorflow"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: the out-of-band pipelines on a CUDA tensor (PyTorch only; see above)")
    p.add_argument("--threads", type=int, default=1, help="torch/TensorFlow threads (one per rank, as in training)")
    p.add_argument("--same-gradient", action="store_true", help="repeat one gradient instead of drawing new ones")
    p.add_argument("--out", help="append one JSON line per measurement")
    p.add_argument("--json", help="write every measurement, and the run's settings, as one JSON file")
    p.add_argument("--update-md", help="replace the throughput section of this markdown file")
    p.add_argument("--count", action="store_true",
                   help="count ops, host syncs and transfers of one step instead of timing (mpirun -np 2)")
    p.add_argument("--sync-count", action="store_true",
                   help="count one P = 1 step of each out-of-band pipeline on --device instead of timing: "
                        "ops, syncs, transfers; on CUDA the synchronising calls torch reports")
    p.add_argument("--count-tensors", type=int, nargs=2, default=[30, 120], metavar=("FEW", "MANY"),
                   help="the two gradient counts of --count (32 x 32 floats each)")
    return p.parse_args()


def fused_params(spec):
    """The out-of-band compressors' small-tensor policy does not apply to one big gradient anyway."""
    if spec in HOROVOD:
        return {}
    import horovod_sparse
    return {"dense_below": 0} if getattr(horovod_sparse.create(spec), "out_of_band", False) else {}


def torch_round_trip(spec, gradient, same_gradient=False, device="cpu"):
    """(prepare, run): prepare sets the gradient tensor on ``device`` (untimed), run is one
    round trip through the frontend."""
    import torch
    import horovod_sparse.torch as hvds
    if spec in HOROVOD:  # Horovod's own, e.g. hvd.Compression.fp16
        from horovod.torch.compression import Compression
        compressor = getattr(Compression, HOROVOD[spec])
    else:
        compressor = hvds.Compression.from_spec(spec, **fused_params(spec))
    source = torch.from_numpy(gradient).to(device)
    tensor = source.clone()
    generator = torch.Generator(device=device).manual_seed(1)

    def prepare():
        if same_gradient:
            tensor.copy_(source)
        else:
            torch.randn(tensor.shape, generator=generator, out=tensor)
        _synchronize(device)

    def run():
        payload, ctx = compressor.compress(tensor)
        result = compressor.decompress(payload, ctx)  # at P = 1 the reduced payload is the payload
        _synchronize(device)
        return result
    return prepare, run


def cuda_round_trip(spec, gradient, same_gradient, horovod_there):
    """``--device cuda``: an out-of-band compressor's pipeline on the device; an in-band one (and
    Horovod's own) through the frontend on the device, where Horovod is importable, else None."""
    if fused_params(spec):
        return pipeline_round_trip(spec, gradient, "cuda", same_gradient)
    return torch_round_trip(spec, gradient, same_gradient, "cuda") if horovod_there else None


def pipeline_round_trip(spec, gradient, device, same_gradient=False):
    """(prepare, run) of one out-of-band pipeline's step on a torch tensor on ``device`` at
    P = 1, the result written back into the gradient as the PyTorch frontend does."""
    import torch
    from mpi4py import MPI
    import horovod_sparse
    from horovod_sparse.layout import GradientLayout
    layout = GradientLayout([("gradient", gradient.shape, "float32")])
    pipe = horovod_sparse.create(spec).make_pipeline(layout.n, MPI.COMM_SELF, layout=layout)
    source = torch.from_numpy(gradient).to(device)
    flat = source.clone().reshape(-1)
    generator = torch.Generator(device=device).manual_seed(1)

    def prepare():
        if same_gradient:
            flat.copy_(source.reshape(-1))
        else:
            torch.randn(flat.shape, generator=generator, out=flat)
        _synchronize(device)

    def run():
        if hasattr(pipe, "step_sparse"):  # the sparsifiers hand back (indices, values) of the sum
            indices, values = pipe.step_sparse(flat, tag=layout.tag)
            flat.zero_()
            flat[torch.as_tensor(indices, device=flat.device)] = torch.as_tensor(values, device=flat.device)
        else:
            flat.copy_(torch.as_tensor(pipe.step(flat, tag=layout.tag), device=flat.device))
        _synchronize(device)
    run.gradient = flat  # what the step wrote into (its tests read it)
    return prepare, run


def _synchronize(device):
    if str(device).startswith("cuda"):
        __import__("torch").cuda.synchronize()


def torch_copy(gradient, device="cpu"):
    import torch
    src = torch.from_numpy(gradient).to(device)
    dst = torch.empty_like(src)

    def run():
        dst.copy_(src)
        _synchronize(device)
    return lambda: None, run


def torch_check(gradient, device="cpu"):
    """The overflow check alone (included in every stateful compressor's round trip)."""
    import torch
    from horovod_sparse.ops.finite import all_finite
    src = torch.from_numpy(gradient).reshape(-1).to(device)
    return lambda: None, lambda: all_finite(src)


def tensorflow_round_trip(spec, gradient, same_gradient=True):
    import tensorflow as tf
    import horovod_sparse.tensorflow as hvds
    if spec in HOROVOD:
        compressor = getattr(__import__("horovod.tensorflow", fromlist=["Compression"]).Compression, HOROVOD[spec])
    else:
        compressor = hvds.Compression.from_spec(spec, **fused_params(spec))
    tensor = tf.constant(gradient)

    @tf.function
    def round_trip(t):
        payload, ctx = compressor.compress(t)
        return compressor.decompress(payload, ctx)

    return lambda: None, lambda: round_trip(tensor).numpy()


def measure(prepare, run, args):
    for _ in range(args.warmup):
        prepare()
        run()
    times = []
    for _ in range(args.repeats):
        prepare()
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return times


def markdown(records, args):
    n = args.rows * args.cols
    by = {(r["spec"], r["framework"]): r for r in records}
    frameworks = [fw for fw in ("torch", "tensorflow") if fw in args.frameworks]
    names = {"torch": "torch", "tensorflow": "TensorFlow"}
    lines = [f"Compress + decompress of one {n / 1e6:.0f}M-element float32 gradient ({n * 4 / 1e6:.0f} MB) "
             f"through each frontend at P = 1, {args.threads} thread(s), median of {args.repeats} after "
             f"{args.warmup} warm-up, {'one gradient repeated' if args.same_gradient else 'a new gradient each call'}"
             f"; {platform.node()}, {os.cpu_count()} cores, {_device_name(args.device)}, shared with other "
             "jobs. The first row is a plain copy of the buffer (the memory bound), the second the overflow "
             "check alone (part of every stateful compressor's round trip). Command: "
             "`.venv/bin/python scripts/bench_codecs.py --update-md docs/results/benchmarks.md`.", "",
             "| compressor | " + " | ".join(f"{names[fw]} s | {names[fw]} GB/s | x copy" for fw in frameworks) + " |",
             "|---|" + "---:|---:|---:|" * len(frameworks)]
    for spec in [COPY, CHECK] + args.specs:
        cells = []
        for fw in frameworks:
            r, copy = by.get((spec, fw)), by.get((COPY, fw))
            if r is None:
                cells += ["-", "-", "-"]
                continue
            ratio = f"{r['median_s'] / copy['median_s']:.1f}" if copy else "-"
            cells += [f"{r['median_s']:.3f}", f"{r['gb_per_s']:.2f}", ratio]
        lines.append(f"| {spec} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _device_name(device):
    if device == "cpu":
        return "no GPU"
    import torch
    return f"the pipelines on {torch.cuda.get_device_name()} (torch {torch.__version__})"


def record(spec, framework, times, n_bytes, args):
    median = statistics.median(times)
    rec = dict(spec=spec, framework=framework, n=n_bytes // 4, median_s=median, min_s=min(times),
               max_s=max(times), gb_per_s=n_bytes / median / 1e9, repeats=args.repeats,
               threads=args.threads)
    print(f"{spec:24s} {framework:10s} median {median:.4f} s  {rec['gb_per_s']:.2f} GB/s  "
          f"(min {min(times):.4f}, max {max(times):.4f})", flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    return rec


def count_table(counts, few, many):
    """The markdown table of :func:`count_all`'s counts: at ``few`` and ``many`` gradients, and the
    growth per additional one."""
    from horovod_sparse.bench.counts import growth
    lines = [f"| compressor | aten ops {few} / {many} | per tensor | not views, per tensor | host syncs {few} / {many} "
             "| per tensor | transfers out (bytes) | transfers in (bytes) | handed to MPI out / in |",
             "|---|---:|---:|---:|---:|---:|---|---|---|"]
    for spec, (low, high) in counts.items():
        more = growth(low, high, few, many)
        lines.append(f"| {spec} | {low['ops']} / {high['ops']} | {more['ops']:.1f} | {more['not_views']:.1f} | {low['syncs']} / "
                     f"{high['syncs']} | {more['syncs']:.2f} | {low['transfers_out']} ({low['bytes_out']}) / "
                     f"{high['transfers_out']} ({high['bytes_out']}) | {low['transfers_in']} ({low['bytes_in']}) / "
                     f"{high['transfers_in']} ({high['bytes_in']}) | {low['handed_out']} / {low['handed_in']} |")
    return "\n".join(lines) + "\n"


def sync_counts(spec, gradient, device):
    """``--sync-count``: one P = 1 step of an out-of-band pipeline on ``device`` (the round trip
    this script times), after two, counted: the aten ops and host synchronisations torch's
    dispatcher sees and the host crossings (:class:`~horovod_sparse.ops.counting.DeviceCounts`),
    and on CUDA every synchronising call torch itself reports under
    ``torch.cuda.set_sync_debug_mode("warn")`` (``cuda_syncs``: the copies' and event waits'
    too, which no dispatcher sees; None on the CPU). The CPU runs the device path."""
    import warnings
    import torch
    from horovod_sparse.ops import cpu
    from horovod_sparse.ops.counting import DeviceCounts
    prepare, run = pipeline_round_trip(spec, gradient, device)
    counts, cuda = DeviceCounts(), str(device).startswith("cuda")
    with cpu.device_path():
        for _ in range(2):
            prepare()
            run()
        prepare()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with counts:
                    run()
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
    summary = counts.summary()
    summary["cuda_syncs"] = sum("synchroniz" in str(w.message) for w in caught) if cuda else None
    return summary


def sync_table(counts):
    """The markdown table of :func:`sync_counts`' counts, one row per spec."""
    lines = ["| compressor | aten ops | not views | host syncs (dispatcher) | synchronising calls (CUDA) "
             "| transfers out / in | handed to MPI out / in |", "|---|---:|---:|---:|---:|---|---|"]
    for spec, c in counts.items():
        cuda = "-" if c["cuda_syncs"] is None else c["cuda_syncs"]
        lines.append(f"| {spec} | {c['ops']} | {c['not_views']} | {c['syncs']} | {cuda} | "
                     f"{c['transfers_out']} / {c['transfers_in']} | {c['handed_out']} / {c['handed_in']} |")
    return "\n".join(lines) + "\n"


def count_all(args):
    """``--count``: {spec: (counts at few, counts at many)} for the out-of-band specs, rank 0's."""
    from horovod_sparse.bench.counts import count_step
    few, many = args.count_tensors
    counts = {}
    for spec in args.specs:
        if spec in HOROVOD or not fused_params(spec):  # in-band: Horovod's allreduce carries them
            continue
        counts[spec] = (count_step(spec, few), count_step(spec, many))
    return counts


def main():
    args = parse_args()
    from mpi4py import MPI  # noqa: F401  (initialises MPI before the frameworks' Horovod)
    import torch
    torch.set_num_threads(args.threads)
    try:
        import horovod.torch as hvd_torch
        hvd_torch.init()
    except ImportError as error:  # a GPU image without Horovod: the pipelines alone (--device cuda)
        if args.device == "cpu":
            raise
        print(f"Horovod is not importable ({error}): the in-band compressors are skipped", flush=True)
        hvd_torch = None
    if args.count:
        counts = count_all(args)
        if hvd_torch.rank() == 0:
            print(count_table(counts, *args.count_tensors), flush=True)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(dict(settings=dict(tensors=args.count_tensors, size=hvd_torch.size(),
                                                 host=platform.node()), counts=counts), f, indent=1)
        return
    if args.device == "cuda":
        args.frameworks = ["torch"]
    gradient = np.random.default_rng(0).standard_normal((args.rows, args.cols)).astype(np.float32)
    if args.sync_count:
        counts = {spec: sync_counts(spec, gradient, args.device) for spec in args.specs if fused_params(spec)}
        print(sync_table(counts), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(settings=dict(rows=args.rows, cols=args.cols, device=args.device,
                                             host=platform.node()), counts=counts), f, indent=1)
        return
    makers = {"torch": torch_round_trip, "tensorflow": tensorflow_round_trip}
    if args.device == "cuda":
        makers["torch"] = lambda spec, g, same: cuda_round_trip(spec, g, same, hvd_torch is not None)
    records = []
    if "torch" in args.frameworks:
        records.append(record(COPY, "torch", measure(*torch_copy(gradient, args.device), args), gradient.nbytes, args))
        records.append(record(CHECK, "torch", measure(*torch_check(gradient, args.device), args),
                              gradient.nbytes, args))
    if "tensorflow" in args.frameworks:
        import tensorflow as tf
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)
        src = tf.constant(gradient)
        copy = tf.function(lambda t: tf.identity(t) + 0.0)
        records.append(record(COPY, "tensorflow", measure(lambda: None, lambda: copy(src).numpy(), args),
                              gradient.nbytes, args))
    for spec in args.specs:
        for fw in args.frameworks:
            round_trip = makers[fw](spec, gradient, args.same_gradient)
            if round_trip is None:
                continue
            records.append(record(spec, fw, measure(*round_trip, args), gradient.nbytes, args))
    table = markdown(records, args)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(settings=dict(rows=args.rows, cols=args.cols, repeats=args.repeats, device=args.device,
                                         warmup=args.warmup, threads=args.threads,
                                         same_gradient=args.same_gradient, host=platform.node(),
                                         cores=os.cpu_count()), records=records), f, indent=1)
    if args.update_md:
        replace_block(args.update_md, "throughput", table, heading="## Compress + decompress throughput")


if __name__ == "__main__":
    main()
