"""The ``horovod-sparse`` command line.

    horovod-sparse list                                   # compressors and their parameters
    horovod-sparse profile --model horovod_sparse.whatif.models:mlp5 --batch 16 -o mlp5.json
    horovod-sparse whatif mlp5.json --workers 8 16 64 --bandwidth 1 10 25 100 --plot mlp5.png
    horovod-sparse whatif netai:vgg16 --ratio 1 2 5 10 50 100 --workers 16 32 64 \\
        --bandwidth 1 10 25 40 100 --rule netai --no-latency --no-codec-cost   # the paper's model
    horovod-sparse bench --links loopback 1gbit --models mlp5   # scripts/bench_step.py's flags
    mpirun -np 2 --bind-to none --mca mpi_yield_when_idle 1 horovod-sparse doctor   # check a launch

Bad arguments exit with code 2 and a message saying what is wrong (argparse's convention).
Same as ``python -m horovod_sparse.cli``.
"""
import argparse
import inspect
import json
import os
import subprocess
import sys

PROG = "horovod-sparse"


# ------------------------------------------------------------------ argument types
def _number(convert, noun, accepts, bound):
    """An argparse type: ``convert(text)``, refused unless ``accepts(value)`` (``bound`` says
    what is accepted)."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun}, got {text!r}") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value
    return parse


_positive_int = _number(int, "a whole number", lambda v: v >= 1, ">= 1")
_positive_float = _number(float, "a number", lambda v: 0 < v < float("inf"), "a finite number > 0")
_nonnegative_float = _number(float, "a number", lambda v: 0 <= v < float("inf"), "a finite number >= 0")


# --------------------------------------------------------------------------- parser
def build_parser():
    from horovod_sparse.whatif.model import DEFAULT_LATENCY_S, RULES
    from horovod_sparse.whatif.profile import DEFAULT_COMPRESSORS

    p = argparse.ArgumentParser(prog=PROG, description="Gradient compressors for Horovod: list them, "
                                "profile a model, predict whether compression pays, run the step benchmark, "
                                "check a launch.")
    sub = p.add_subparsers(dest="command", metavar="{list,profile,whatif,bench,doctor}")
    sub.required = True

    sub.add_parser("list", help="the compressors, their parameters and defaults")

    pr = sub.add_parser("profile", help="measure a model's backward trace and each compressor's cost here",
                        description="Measure a PyTorch model's per-gradient backward times and every "
                        "compressor's compress+decompress cost on this device; write a JSON trace. "
                        "--model names a factory returning a torch.nn.Module with example_batch(B), or "
                        "(model, make_batch) or (model, make_batch, loss_fn); make_batch(B) returns "
                        "(x, y) or x. See docs/choosing.md and docs/results/whatif.md.")
    pr.add_argument("--model", required=True, metavar="PKG.MODULE:FACTORY",
                    help="e.g. horovod_sparse.whatif.models:mlp5")
    pr.add_argument("--batch", required=True, type=_positive_int, help="batch size per worker")
    pr.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    pr.add_argument("-o", "--output", required=True, metavar="TRACE.json")
    pr.add_argument("--compressors", nargs="*", default=list(DEFAULT_COMPRESSORS), metavar="SPEC",
                    help="specs to cost (default: the step benchmark's list; none: backward only)")
    pr.add_argument("--steps", type=_positive_int, default=5, help="timed steps (default 5)")
    pr.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    pr.add_argument("--repeats", type=_positive_int, default=3, help="timed codec steps (default 3)")
    pr.add_argument("--threads", type=_positive_int, help="torch threads (default: torch's)")
    pr.add_argument("--name", help="model name stored in the trace (default: the factory's)")
    pr.add_argument("--np", type=_positive_int, metavar="P",
                    help="profile P ranks at once under mpirun on this machine (what P workers pay "
                    "here: contention, the out-of-band pipelines at P); the same as running "
                    "`mpirun -np P horovod-sparse profile ...`")
    pr.add_argument("--quiet", action="store_true", help="no progress output")

    wi = sub.add_parser("whatif", help="predict step time and scaling with each compressor",
                        description="Predict the step time, the communication overhead beyond backward, "
                        "the scaling factor t_batch/(t_batch+overhead) and the speed-up over dense, per "
                        "compressor (or plain compression ratio), cluster size and link; recommend one.")
    wi.add_argument("trace", metavar="TRACE", help="a JSON trace from `profile`, a NetAI .bk.log, or "
                    "netai:resnet50 / netai:resnet101 / netai:vgg16")
    wi.add_argument("--workers", nargs="+", type=_positive_int, default=[8, 16, 64], metavar="P")
    wi.add_argument("--bandwidth", nargs="+", type=_positive_float, default=[1.0, 10.0, 25.0, 100.0],
                    metavar="GBPS", help="per-worker link, Gbit/s (1e9 bit/s)")
    wi.add_argument("--latency", type=_nonnegative_float, default=DEFAULT_LATENCY_S, metavar="SECONDS",
                    help=f"per message round (default {DEFAULT_LATENCY_S:g})")
    wi.add_argument("--cost", nargs=2, type=float, metavar=("A", "B"),
                    help="instead of --bandwidth/--latency: a measured ring allreduce cost "
                    "A + B*M (seconds, seconds per byte) at --cost-workers ranks")
    wi.add_argument("--cost-workers", type=_positive_int, metavar="P",
                    help="ranks --cost was measured at (default: the first --workers)")
    what = wi.add_mutually_exclusive_group()
    what.add_argument("--compressors", nargs="+", metavar="SPEC", help="default: the trace's")
    what.add_argument("--ratio", nargs="+", type=_positive_float, metavar="C",
                      help="plain compression ratios instead (the paper's model)")
    what.add_argument("--auto", nargs="*", metavar="SPEC",
                      help="what Compression.auto would pick, per gradient, among these candidates "
                      "(default: fp16 topk:density=0.01 powersgd:rank=2); see docs/auto.md")
    what.add_argument("--sparse-allreduce", action="store_true",
                      help="which sparse allreduce of the engine (dense, TopkA, gTop-k, TopkDSA, Ok-Topk) is "
                      "predicted fastest for the trace's gradient at each --workers and --bandwidth "
                      "(costs fitted to timed exchanges; docs/results/oktopk-scale.md)")
    wi.add_argument("--density", type=_positive_float, default=0.01,
                    help="with --sparse-allreduce: k = density x the gradient's elements (default 0.01)")
    wi.add_argument("--rule", choices=RULES, default=None,
                    help="bucket rule (default: horovod for named compressors, netai for --ratio)")
    wi.add_argument("--no-latency", action="store_true", help="drop the latency term (as the paper)")
    wi.add_argument("--no-codec-cost", action="store_true", help="ignore the codec's cost (as the paper)")
    ov = wi.add_mutually_exclusive_group()
    ov.add_argument("--overlap", dest="overlap", action="store_true", default=None,
                    help="allreduces overlap backward (default: yes unless the trace is from a CPU)")
    ov.add_argument("--no-overlap", dest="overlap", action="store_false")
    wi.add_argument("--batch-time", type=_positive_float, metavar="SECONDS", help="override t_batch")
    wi.add_argument("--fwd-bwd", type=_positive_float, metavar="SECONDS",
                    help="measured forward+backward of your dense training where it runs; scales the "
                    "profile's compute and codec (ranks sharing a machine)")
    wi.add_argument("--margin", type=_nonnegative_float, default=0.05,
                    help="speed-up over dense a compressor needs to be recommended (default 0.05)")
    wi.add_argument("--plot", metavar="OUT.png", help="scaling factor vs bandwidth per compressor")
    wi.add_argument("--json", action="store_true", help="print the rows as one JSON list, nothing else")

    sub.add_parser("bench", help="run the step benchmark (scripts/bench_step.py; flags passed through)",
                   add_help=False)

    from horovod_sparse import doctor
    dr = sub.add_parser("doctor", help="check a launch (run it under mpirun or horovodrun like the job)",
                        description="Run under mpirun or horovodrun the way the training job will run: "
                        "checks that mpi4py's world is Horovod's, the MPI library and Horovod's build, "
                        "CUDA, the versions, ranks against cores (mpi_yield_when_idle), threads, and "
                        "measures the link between the ranks. Rank 0 prints OK/WARN/FAIL per check with "
                        "the fix; every rank exits 0 when the launch is sound, 1 otherwise.")
    doctor.add_arguments(dr, _positive_int, _positive_float)
    return p


# ------------------------------------------------------------------------- commands
def cmd_list(_args, out):
    import horovod_sparse
    from horovod_sparse.catalogue import signature_defaults
    from horovod_sparse.registry import get
    from horovod_sparse.whatif import wire
    rows = [("dense", "horovod", "", "Horovod's own Compression.none (the benchmark's name)"),
            ("hvd-fp16", "horovod", "", "Horovod's own Compression.fp16")]
    for name in horovod_sparse.available():
        cls = get(name)
        params = [f"{k}={v!r}" for k, v in signature_defaults(cls).items()]
        doc = (inspect.getdoc(cls) or "").split("\n")[0]
        if name == "dense":  # plain "dense" names the baseline above; with parameters, ours out of band
            rows.append(("dense:...", "out_of_band", " ".join(params + ["schedule='after_backward'"]), doc))
            continue
        rows.append((name, wire.carrier(name), " ".join(params), doc))
    rows.append(_auto_row())
    width = max(len(r[0]) for r in rows)
    for name, carrier, params, doc in rows:
        print(f"{name:<{width}}  {carrier:<7}  {params}".rstrip() + (f"  # {doc}" if doc else ""), file=out)
    return 0


def _auto_row():
    """``auto``: its parameters are the framework-free runtime's (both frontends take them);
    it carries each gradient by Horovod or out of band, whichever it picked."""
    from horovod_sparse.auto.runtime import AutoRuntime
    from horovod_sparse.catalogue import signature_defaults
    params = [f"{k}={v!r}" for k, v in signature_defaults(AutoRuntime).items()]
    return ("auto", "both", " ".join(params), "Compression.auto(): per gradient, Horovod's fp32/fp16 "
            "allreduce or an out-of-band candidate, picked from measurements (docs/auto.md)")


def _relaunch_under_mpirun(np_, argv, parser):
    """``profile --np P``: the same command on P ranks of this machine (Open MPI's mpirun)."""
    import shutil
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        parser.error("--np needs mpirun (Open MPI) on the PATH")
    rest, skip = [], False
    for arg in argv:   # drop --np P / --np=P
        if skip:
            skip = False
        elif arg == "--np":
            skip = True
        elif not arg.startswith("--np="):
            rest.append(arg)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if hasattr(os, "geteuid") and os.geteuid() == 0:   # mpirun refuses root without these
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    command = [mpirun, "-np", str(np_), "--oversubscribe", "--bind-to", "none", "--mca", "mpi_yield_when_idle",
               "1", sys.executable, "-m", "horovod_sparse.cli", *rest]
    return subprocess.call(command, env=env)


def cmd_profile(args, parser, out, argv=()):
    from horovod_sparse.whatif import profile as prof
    from horovod_sparse.whatif import wire
    for spec in args.compressors:
        try:
            wire.parse(spec)
        except ValueError as e:
            parser.error(f"--compressors: {e}")
    if args.warmup < 0:
        parser.error("--warmup must be >= 0")
    if args.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():
            parser.error(f"--device {args.device}: CUDA is not available here")
    elif args.device != "cpu":
        parser.error(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    try:
        factory = prof.load_factory(args.model)
    except ValueError as e:
        parser.error(str(e))
    if args.np and args.np > 1 and not prof.launched_by_mpirun():
        return _relaunch_under_mpirun(args.np, argv, parser)
    try:
        trace = prof.profile(factory, args.batch, device=args.device, steps=args.steps, warmup=args.warmup,
                             compressors=args.compressors, repeats=args.repeats, threads=args.threads,
                             model_name=args.name or args.model.split(":")[-1], show_progress=not args.quiet)
    except ValueError as e:
        parser.error(f"--model {args.model}: {e}")
    if trace is None:   # not rank 0 of mpirun: rank 0 writes the trace
        return 0
    trace.meta["factory"] = args.model
    trace.save(args.output)
    print(f"{args.output}: {len(trace.gradients)} gradients, {trace.nbytes / 1e6:.1f} MB, batch "
          f"{trace.batch_time_s * 1e3:.1f} ms (backward {trace.backward_s * 1e3:.1f} ms), "
          f"{len(trace.compressors)} compressors costed at P = {trace.workers}", file=out)
    for spec, err in trace.meta.get("errors", {}).items():
        print(f"  {spec}: not costed ({err})", file=out)
    return 0


def _table(title, headers, rows, out):
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None
    if Console is not None and out is sys.stdout:
        table = Table(title=title)
        for i, h in enumerate(headers):
            table.add_column(h, justify="left" if i == 0 else "right")
        for r in rows:
            table.add_row(*r)
        Console(width=max(100, 14 * len(headers) + 30)).print(table)
        return
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print(title, file=out)
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(headers, widths))), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))), file=out)
    print(file=out)


def cmd_whatif(args, parser, out):
    from horovod_sparse.schedule.cost import CostModel
    from horovod_sparse.whatif import Network, Options, contention, load, recommend, sweep, wire
    try:
        trace = load(args.trace, batch_time_s=args.batch_time)
    except (ValueError, OSError, KeyError) as e:
        parser.error(f"TRACE: {e}")
    if args.auto is not None:
        return cmd_whatif_auto(args, parser, trace, out)
    if args.sparse_allreduce:
        return cmd_whatif_sparse(args, parser, trace, out)
    compressors, ratios = args.compressors, args.ratio
    if compressors is None and ratios is None:
        if trace.compressors:
            compressors = list(trace.compressors)
        else:
            ratios = [1, 2, 5, 10, 50, 100]
    if compressors is not None:
        for spec in compressors:
            try:
                wire.parse(spec)
            except ValueError as e:
                parser.error(f"--compressors: {e}")
    rule = args.rule or ("netai" if ratios is not None else "horovod")
    try:
        slow = contention(trace, args.fwd_bwd) if args.fwd_bwd else 1.0
    except ValueError as e:
        parser.error(f"--fwd-bwd: {e}")
    options = Options(rule=rule, latency=not args.no_latency, codec=not args.no_codec_cost,
                      overlap=args.overlap, compute_scale=slow)
    network = None
    if args.cost is not None:
        p0 = args.cost_workers or args.workers[0]
        try:
            net = Network.from_allreduce(CostModel(*args.cost), p0)
        except ValueError as e:
            parser.error(f"--cost: {e}")
        network = lambda _p: net  # noqa: E731  (one link, whatever the cluster size)
    preds = sweep(trace, args.workers, gbps=args.bandwidth, compressors=compressors, ratios=ratios,
                  options=options, latency_s=args.latency, network=network)
    recs = recommend(preds, margin=args.margin)
    if args.plot:
        from horovod_sparse.whatif.plot import plot
        plot(preds, args.plot, title=f"{trace.model}: scaling factor ({rule} buckets)")
    if args.json:
        json.dump([p.row() for p in preds], out)
        out.write("\n")
        return 0
    lat = "no latency" if args.no_latency else f"latency {preds[0].latency_s * 1e6:g} us/round"
    print(f"{trace.model} on {trace.device}: t_batch {trace.batch_time_s * 1e3:.1f} ms, backward "
          f"{trace.backward_s * 1e3:.1f} ms, {len(trace.gradients)} gradients, {trace.nbytes / 1e6:.1f} MB; "
          f"{rule} buckets, {lat}, codec cost {'off' if args.no_codec_cost else 'on'}, overlap "
          f"{'on' if (trace.on_gpu if args.overlap is None else args.overlap) else 'off'}", file=out)
    gbps = list(dict.fromkeys(p.gbps for p in preds))
    labels = list(dict.fromkeys(p.label for p in preds))
    by = {(p.label, p.workers, p.gbps): p for p in preds}
    for w in args.workers:
        rows = []
        for label in labels:
            cells = []
            for g in gbps:
                p = by[(label, w, g)]
                sp = f" {p.speedup:.2f}x" if p.speedup is not None else ""
                cells.append(f"{p.step_s * 1e3:.1f} ms {p.scaling:.2f}{sp}")
            rows.append([label] + cells)
        _table(f"{w} workers: step time, scaling factor, speed-up over dense",
               ["compressor" if compressors is not None else "ratio"] + [f"{g:g} Gbit/s" for g in gbps], rows, out)
    print("Recommendation (shortest predicted step; 'none' unless it beats dense by "
          f"{args.margin:.0%}):", file=out)
    for r in recs:
        if r.choice != "none":
            why = f"{r.speedup:.2f}x over dense"
        elif r.best in ("dense", "none", "x1"):
            why = "dense is fastest"
        else:
            why = f"best other: {r.best} {r.speedup:.2f}x"
        print(f"  {r.workers:>4} workers, {r.gbps:g} Gbit/s: {r.choice}  ({why}; dense scaling {r.dense_scaling:.2f})",
              file=out)
    notes = sorted({n for p in preds for n in p.notes})
    for n in notes:
        print(f"note: {n}", file=out)
    if args.plot:
        print(f"plot: {args.plot}", file=out)
    return 0


def cmd_whatif_auto(args, parser, trace, out):
    """``whatif --auto``: per cluster size and link, the plan auto would try first, and per
    gradient its choice."""
    from horovod_sparse.auto.decide import DEFAULT_CANDIDATES
    from horovod_sparse.whatif.auto import auto_choice
    candidates = args.auto or list(DEFAULT_CANDIDATES)
    cells, rows = [], []
    try:
        for w in args.workers:
            for g in args.bandwidth:
                cells.append(((w, g), auto_choice(trace, w, g, candidates, latency_s=args.latency)))
    except ValueError as e:
        parser.error(f"--auto: {e}")
    if args.json:
        json.dump([{"workers": w, "gbps": g, "plan": name, "predicted_s": seconds, "choices": plan}
                   for (w, g), (name, plan, seconds) in cells], out)
        out.write("\n")
        return 0
    print(f"{trace.model} on {trace.device}: backward {trace.backward_s * 1e3:.1f} ms, {len(trace.gradients)} "
          f"gradients, {trace.nbytes / 1e6:.1f} MB; candidates {', '.join(candidates)}. What Compression.auto "
          "would try first (its prediction; the run's trials decide between the best few):", file=out)
    _table("best predicted plan per cluster size and link", ["workers", "Gbit/s", "plan", "exchanges end (ms)"],
           [[str(w), f"{g:g}", name, f"{seconds * 1e3:.1f}"] for (w, g), (name, _, seconds) in cells], out)
    headers = ["gradient", "MB"] + [f"P={w} {g:g}G" for (w, g), _ in cells]
    for grad in trace.gradients:
        rows.append([grad.name, f"{grad.nbytes / 1e6:.2f}"] + [plan[grad.name] for _, (_, plan, _) in cells])
    _table("choice per gradient (backward order)", headers, rows, out)
    for spec in candidates:
        if spec not in ("none", "fp16") and spec not in trace.compressors:
            print(f"note: the trace has no codec cost for {spec}: counted as free (profile it with "
                  f"`horovod-sparse profile --compressors {spec}`)", file=out)
    return 0


def cmd_whatif_sparse(args, parser, trace, out):
    """``whatif --sparse-allreduce``: per cluster size and link, one exchange of the trace's
    gradient by each of the engine's algorithms (:mod:`horovod_sparse.whatif.exchange_cost`)."""
    from horovod_sparse.whatif import exchange_cost as ec
    from horovod_sparse.whatif.volumes import LABELS
    if args.density > 1:
        parser.error("--density must be in (0, 1]")
    n = int(trace.nbytes // 4)
    k = max(1, int(round(args.density * n)))
    cells = []
    for w in args.workers:
        for g in args.bandwidth:
            best, times = ec.fastest(n, k, w, ec.default_cost(g))
            cells.append((w, g, best, times))
    if args.json:
        json.dump([{"workers": w, "gbps": g, "fastest": best, "n": n, "k": k, "seconds": times}
                   for w, g, best, times in cells], out)
        out.write("\n")
        return 0
    base = ec.default_cost(1.0)
    print(f"{trace.model}: n = {n:,} elements, k = {k:,} (density {args.density:g}); one exchange, predicted "
          f"from the closed forms with {base.alpha_s * 1e6:.0f} us per message (measured), "
          f"{min(base.call_s.values()) * 1e6:.0f}-{max(base.call_s.values()) * 1e6:.0f} us per call and each "
          "algorithm's local work per byte received and per entry selected, fitted to timed "
          "exchanges (docs/results/oktopk-scale.md)",
          file=out)
    _table("predicted ms per exchange", ["workers", "Gbit/s"] + list(LABELS.values()) + ["fastest"],
           [[str(w), f"{g:g}"] + [f"{times[a] * 1e3:,.1f}" for a in LABELS] + [LABELS[best]]
            for w, g, best, times in cells], out)
    return 0


def cmd_doctor(args, parser, out):
    from horovod_sparse import doctor
    doctor.check_arguments(args, parser)
    return doctor.run(args, out)


def bench_script():
    """scripts/bench_step.py of the source checkout this package runs from, or None."""
    import horovod_sparse
    root = os.path.dirname(os.path.dirname(os.path.abspath(horovod_sparse.__file__)))
    path = os.path.join(root, "scripts", "bench_step.py")
    return path if os.path.isfile(path) else None


def cmd_bench(argv, err):
    script = bench_script()
    if script is None:
        print(f"{PROG} bench: error: needs a source checkout of horovod_sparse (scripts/bench_step.py "
              "beside the package); this installation has none", file=err)
        return 2
    return subprocess.call([sys.executable, script, *argv])


def main(argv=None, out=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    out = out or sys.stdout
    if argv and argv[0] == "bench":   # everything after it belongs to bench_step.py
        return cmd_bench(argv[1:], sys.stderr)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "list":
        return cmd_list(args, out)
    sub = parser._subparsers._group_actions[0].choices[args.command]   # errors name the subcommand
    if args.command == "profile":
        return cmd_profile(args, sub, out, argv)
    if args.command == "doctor":
        return cmd_doctor(args, sub, out)
    return cmd_whatif(args, sub, out)


if __name__ == "__main__":
    sys.exit(main())
