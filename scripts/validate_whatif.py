#!/usr/bin/env python3
"""Check the what-if advisor against measured steps: predict every case the step benchmark
measured, from a profile of each model, and compare.

    # 1. a trace per model, on this machine, one thread (as each benchmark rank has); with
    #    --np P -o results/traces/mlp5-p2.json also one profiled at P, used for that P
    M=horovod_sparse.whatif.models
    horovod-sparse profile --model $M:mlp5 --batch 16 --threads 1 -o results/traces/mlp5.json
    horovod-sparse profile --model $M:mlp30 --batch 32 --threads 1 -o results/traces/mlp30.json
    # 2. the measured steps (scripts/bench_step.py), then
    python scripts/validate_whatif.py --measured docs/results/performance.jsonl --traces results/traces \\
        --md results/whatif-validation.md

Inputs: (a) a JSONL of measured steps, one object per (model, np, link, compressor) with at
least ``model, np, link, compressor, fwd_bwd_ms, step_ms, total_ms`` (the last record of a
case wins); (b) traces by model: a directory holding ``<model>.json`` (any P) and
``<model>-p<P>.json`` (profiled at P: ``horovod-sparse profile --np P``, used for that P),
or ``model=path``.

Per measured case the prediction is the advisor's step time (``horovod`` bucket rule, latency
and codec cost on, no overlap on a CPU trace) on P = ``np`` workers, with

* the link of the fused exchanges (the package's own engine): ``--calibrate benchmarks``
  (default) takes the dense ring rows of ``--benchmarks`` (scripts/bench_exchange.py) at this
  rate and P (all P when none matches): one row gives bandwidth = bytes / time with
  ``--latency``, several are fitted as t = a + b * bytes sent per rank (bandwidth 8 / b, latency
  a / 2(P-1)); ``nominal`` takes the tc rate and ``--latency``;
* the link as Horovod's allreduce sees it (dense, fp16, randomk): ``--horovod engine``
  (default) the engine's; ``--horovod dense`` calibrates it per model, link and P from the
  measured dense step (dense - t_batch = 2(P-1) latency + ring bytes / bandwidth). Either way
  the dense rows feed the prediction (their fwd+bwd sets the contention factor, or their step
  the link), so they are in-sample and left out of the error statistics;
* the out-of-band compressors' bytes: the package's own accounting in the record
  (``bytes_sent_per_step``, minus Horovod's share) when present (``--wire measured``), else the
  formulas of horovod_sparse.whatif.wire;
* compute and codec times as profiled (codec times profiled at this P are used as they are),
  times a contention factor
  (``--contention``): ``auto`` (default) is ``none`` for a trace profiled at the case's P
  and ``dense`` otherwise; ``dense`` scales all of them by the measured dense step's
  forward + backward over the profiled one (:func:`horovod_sparse.whatif.model.contention`:
  what P ranks sharing this machine's cores and memory, and Horovod's per-tensor work in the
  hooks, cost; a user has it from the dense training they run today); ``copy`` scales the
  codec only, by the record's ``copy_ms`` (all ranks copying at once) over the trace's
  ``copy_s``; ``none`` takes the profile as it is.

Printed (and written with ``--md``/``--out``): predicted vs measured per case with the relative
error, and per (model, np, link) whether the predicted fastest compressor is the measured
fastest (``hit``), whether its measured time is within ``--tie`` (5 %) of the fastest (``near``:
the two are equal within the benchmark's noise), and what choosing it costs (measured time of
the pick / measured fastest). Targets: |error| <= 20 % and the fastest picked in >= 80 % of the
groups.
"""
import argparse
import json
import os
import re
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from horovod_sparse.schedule.cost import CostModel  # noqa: E402
from horovod_sparse.whatif import Network, Options, load, predict, wire  # noqa: E402
from horovod_sparse.whatif.model import DEFAULT_LATENCY_S, contention  # noqa: E402

TARGET_ERROR, TARGET_PICKS = 0.20, 0.80
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(i?)(bit|bps)$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--measured", required=True, help="JSONL of measured steps (scripts/bench_step.py)")
    p.add_argument("--traces", nargs="+", required=True, metavar="DIR|MODEL=PATH",
                   help="directory with <model>.json, or model=path pairs")
    p.add_argument("--benchmarks", nargs="*", metavar="JSONL",
                   default=[os.path.join(REPO, "docs", "results", "benchmarks.jsonl"),
                            os.path.join(REPO, "docs", "results", "benchmarks-dense-ring.jsonl")],
                   help="scripts/bench_exchange.py results for --calibrate benchmarks")
    p.add_argument("--calibrate", choices=["benchmarks", "nominal"], default="benchmarks",
                   help="link of the fused exchanges (default benchmarks)")
    p.add_argument("--horovod", choices=["dense", "engine"], default="engine",
                   help="link of Horovod's allreduce: as the engine's (default) or from the measured dense step")
    p.add_argument("--latency", type=float, default=DEFAULT_LATENCY_S,
                   help="seconds per message round when not calibrated (default %(default)g)")
    p.add_argument("--rule", default="horovod", choices=["horovod", "netai", "wfbp", "single"])
    p.add_argument("--wire", choices=["measured", "formula"], default="measured")
    p.add_argument("--contention", choices=["auto", "dense", "copy", "none"], default="auto",
                   help="compute slowdown: from the measured dense fwd+bwd, copy_ms / copy_s on the codec "
                   "only, or none; auto (default): none for a trace profiled at the case's P (it holds "
                   "the contention already), dense for a P = 1 trace")
    p.add_argument("--tie", type=float, default=0.05,
                   help="a pick within this fraction of the measured fastest counts as near (default 0.05)")
    p.add_argument("--md", help="write the report as markdown here")
    p.add_argument("--out", help="write one JSON object per case here")
    return p.parse_args(argv)


# ------------------------------------------------------------------------ inputs
def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def measured_cases(path):
    """The last usable record per (model, np, link, compressor), in file order."""
    cases = {}
    for r in read_jsonl(path):
        if r.get("error") or r.get("total_ms") is None:
            continue
        try:
            key = (r["model"], int(r["np"]), r["link"], r["compressor"])
        except KeyError as e:
            raise SystemExit(f"{path}: a record lacks {e}; expected model, np, link, compressor, total_ms")
        cases[key] = r
    return cases


def find_traces(entries):
    """``{(model, P or None): Trace}``: ``<model>.json`` (or ``model=path``) serves every P,
    ``<model>-p<P>.json`` (a profile under ``mpirun -np P``) serves P."""
    paths = {}
    for entry in entries:
        if "=" in entry:
            model, path = entry.split("=", 1)
            paths[model] = path
        elif os.path.isdir(entry):
            for name in sorted(os.listdir(entry)):
                if name.endswith(".json"):
                    paths[name[:-5]] = os.path.join(entry, name)
        else:
            raise SystemExit(f"--traces: {entry!r} is neither a directory nor model=path")
    traces = {}
    for key, path in paths.items():
        at_p = re.fullmatch(r"(.+)-p(\d+)", key)
        traces[(at_p.group(1), int(at_p.group(2))) if at_p else (key, None)] = load(path)
    return traces


def trace_for(traces, model, np_):
    """The trace profiled at P = np_ if there is one, else the model's P-independent one."""
    return traces.get((model, np_)) or traces.get((model, None))


def link_bps(link):
    """A tc rate (1gbit, 10gbit, 500mbit) in bit/s; None for loopback."""
    m = _RATE.match(link.strip().lower())
    if not m:
        return None
    power = " kmgt".index(m.group(2) or " ")
    return float(m.group(1)) * (1024 if m.group(3) else 1000) ** power * (8 if m.group(4) == "bps" else 1)


# ------------------------------------------------------------------- calibration
def calibrate_from_points(points, source, default_latency):
    """points: [(bytes sent per rank, seconds, P)] -> (Network, description)."""
    sizes = [w for w, _, _ in points]
    if len(set(sizes)) >= 2:
        line, r2 = CostModel.fit(sizes, [t for _, t, _ in points])
        if line.b > 0:
            rounds = statistics.mean(2 * (p - 1) for _, _, p in points)
            net = Network(8.0 / line.b, max(0.0, line.a) / rounds)
            return net, (f"{source}: t = {line.a * 1e3:.2f} ms + W / {net.gbps:.3f} Gbit/s, R^2 {r2:.3f}, "
                         f"{len(points)} points")
    w, t, _ = max(points)
    net = Network(w * 8.0 / t, default_latency)
    return net, f"{source}: {net.gbps:.3f} Gbit/s from one point, latency {default_latency * 1e6:g} us assumed"


def calibrate(link, np_, args):
    """The engine's Network for ``link`` at P = ``np_``, and a line saying where it came from."""
    nominal = link_bps(link)
    if args.calibrate == "benchmarks":
        rate = "loopback" if nominal is None else link
        points = []
        for path in args.benchmarks or []:
            if os.path.exists(path):
                points += [(r["bytes_sent_per_rank_max"], r["median_s"], r["P"]) for r in read_jsonl(path)
                           if r.get("algorithm") == "dense" and r.get("rate") == rate
                           and r.get("bytes_sent_per_rank_max") and r.get("median_s")]
        same_p = [pt for pt in points if pt[2] == np_]
        if same_p or points:
            return calibrate_from_points(same_p or points, f"exchange benchmarks, dense ring at {rate}, "
                                         f"P = {np_ if same_p else 'all'}", args.latency)
    if nominal is None:
        raise SystemExit(f"link {link!r}: no rate to assume and nothing to calibrate from "
                         "(give --benchmarks with loopback rows)")
    return Network(nominal, args.latency), f"nominal {nominal / 1e9:g} Gbit/s, latency {args.latency * 1e6:g} us"


def contention_mode(args, trace):
    """``--contention`` for this trace, ``auto`` resolved."""
    if args.contention != "auto":
        return args.contention
    return "none" if trace.workers > 1 else "dense"


def compute_scale(dense_record, trace, args):
    """``Options.compute_scale`` for one model, link and P: the measured dense forward +
    backward over the profiled one (``--contention dense``), else 1."""
    if (contention_mode(args, trace) != "dense" or dense_record is None
            or not dense_record.get("fwd_bwd_ms")):
        return 1.0
    return contention(trace, dense_record["fwd_bwd_ms"] / 1e3, dense_record["compressor"])


def calibrate_horovod(dense_record, trace, engine, args, slow=1.0):
    """Horovod's link for one model, link and P, from its measured dense step; None if unusable.

    With no overlap (a CPU trace) the dense step is t_batch + codec + one ring of the whole
    model (it fits one fusion buffer) or a few: solve the ring's bandwidth, keeping the
    engine's latency."""
    if args.horovod != "dense" or dense_record is None:
        return None
    np_ = int(dense_record["np"])
    probe = predict(trace, engine, np_, compressor=dense_record["compressor"],
                    options=Options(rule=args.rule, compute_scale=slow))
    overhead = dense_record["total_ms"] / 1e3 - probe.batch_s
    fixed = probe.overhead_s - probe.comm_s + probe.buckets * 2 * (np_ - 1) * engine.latency_s
    wire_s = overhead - fixed
    if np_ < 2 or wire_s <= 0:
        return None
    return Network(probe.wire_bytes * 8.0 / wire_s, engine.latency_s)


# -------------------------------------------------------------------- prediction
def fused_wire_bytes(record, trace, spec):
    """The record's own byte count minus what Horovod carried (probes, small gradients)."""
    sent = record.get("bytes_sent_per_step")
    if sent is None or wire.carrier(spec) != "out_of_band":
        return None
    horovod = wire.dense_ring_bytes(sum(wire.payload_bytes(spec, trace.gradients)), int(record["np"]))
    return max(0.0, sent - horovod)


def predict_case(record, trace, network, args, horovod_network=None, slow=1.0):
    spec = record["compressor"]
    scale = 1.0
    if args.contention == "copy" and record.get("copy_ms") and trace.copy_s:
        scale = max(1.0, record["copy_ms"] / 1e3 / trace.copy_s)
    options = Options(rule=args.rule, compute_scale=slow, codec_scale=scale)
    override = fused_wire_bytes(record, trace, spec) if args.wire == "measured" else None
    return predict(trace, network, int(record["np"]), compressor=spec, options=options, wire_bytes=override,
                   horovod_network=horovod_network), scale * slow


def validate(args):
    cases = measured_cases(args.measured)
    traces = find_traces(args.traces)
    missing = sorted({f"{m} (P = {p})" for m, p, *_ in cases if trace_for(traces, m, p) is None})
    networks, hvd_networks, slowdowns, rows = {}, {}, {}, []
    for key, record in cases.items():
        model, np_, link, spec = key
        trace = trace_for(traces, model, np_)
        if trace is None:
            continue
        if (link, np_) not in networks:
            networks[(link, np_)] = calibrate(link, np_, args)
        engine = networks[(link, np_)][0]
        if (model, link, np_) not in hvd_networks:
            dense = next((r for (m, p, lk, c), r in cases.items()
                          if (m, p, lk) == (model, np_, link) and wire.canonical(c) == "none"), None)
            slowdowns[(model, link, np_)] = compute_scale(dense, trace, args)
            hvd_networks[(model, link, np_)] = calibrate_horovod(dense, trace, engine, args,
                                                                 slowdowns[(model, link, np_)])
        hvd_net, slow = hvd_networks[(model, link, np_)], slowdowns[(model, link, np_)]
        try:
            pred, scale = predict_case(record, trace, engine, args, hvd_net, slow)
        except ValueError as e:   # a compressor this version does not know
            print(f"skipped {key}: {e}", file=sys.stderr)
            continue
        measured = record["total_ms"]
        rows.append(dict(model=model, np=np_, link=link, compressor=spec, measured_ms=measured,
                         predicted_ms=pred.step_s * 1e3, error=pred.step_s * 1e3 / measured - 1,
                         in_sample=wire.canonical(spec) == "none" and (
                             hvd_net is not None or contention_mode(args, trace) == "dense"),
                         measured_fwd_bwd_ms=record.get("fwd_bwd_ms"), measured_step_ms=record.get("step_ms"),
                         predicted_overhead_ms=pred.overhead_s * 1e3, codec_ms=pred.codec_s * 1e3,
                         comm_ms=pred.comm_s * 1e3, wire_bytes=pred.wire_bytes, codec_scale=scale))
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["np"], r["link"]), []).append(r)
    picks = []
    for (model, np_, link), rs in groups.items():
        if len(rs) < 2:
            continue
        by_measured = sorted(rs, key=lambda r: r["measured_ms"])
        fastest, runner_up = by_measured[0], by_measured[1]
        pick = min(rs, key=lambda r: r["predicted_ms"])
        picks.append(dict(model=model, np=np_, link=link, measured_fastest=fastest["compressor"],
                          predicted_fastest=pick["compressor"], hit=pick is fastest,
                          near=pick["measured_ms"] <= fastest["measured_ms"] * (1 + args.tie),
                          regret=pick["measured_ms"] / fastest["measured_ms"], cases=len(rs),
                          margin=runner_up["measured_ms"] / fastest["measured_ms"] - 1))
    calib = {f"{lk} P={p}": how for (lk, p), (_, how) in networks.items()}
    for (model, lk, p), net in hvd_networks.items():
        if net is not None:
            calib[f"{lk} P={p} Horovod, {model}"] = f"from the measured dense step: {net.gbps:.3f} Gbit/s"
    return rows, picks, calib, missing


def summarize(rows, picks):
    """One line: errors of the out-of-sample cases, picks (strict and within the tie)."""
    scored = [r for r in rows if not r["in_sample"]]
    within = sum(abs(r["error"]) <= TARGET_ERROR for r in scored)
    hits = sum(p["hit"] for p in picks)
    near = sum(p["near"] for p in picks)
    median = statistics.median([abs(r["error"]) for r in scored]) if scored else float("nan")
    regret = statistics.mean([p["regret"] for p in picks]) if picks else float("nan")
    return (f"{len(scored)} cases predicted ({len(rows) - len(scored)} dense rows in-sample, left out): "
            f"{within} within {TARGET_ERROR:.0%} ({within / max(1, len(scored)):.0%}), median |error| {median:.0%}; "
            f"fastest picked in {hits}/{len(picks)} groups ({hits / max(1, len(picks)):.0%}; target "
            f"{TARGET_PICKS:.0%}), within the tie in {near}/{len(picks)}, measured time of the pick "
            f"{regret:.2f}x the fastest on average")


# ------------------------------------------------------------------------ report
def report(rows, picks, calib, missing, args):
    lines = [f"What-if validation: `{args.measured}`; engine link `{args.calibrate}`, Horovod link "
             f"`{args.horovod}`, rule `{args.rule}`, wire `{args.wire}`, contention "
             f"`{args.contention}`.", ""]
    for what, how in calib.items():
        lines.append(f"- {what}: {how}")
    if missing:
        lines.append(f"- no trace for {', '.join(missing)}: run `horovod-sparse profile --model "
                     "horovod_sparse.whatif.models:<model> --batch <B> --threads 1 -o <dir>/<model>.json`")
    lines += ["", "| model | P | link | compressor | measured ms | predicted ms | error | codec ms | comm ms |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        err = f"{r['error']:+.0%}" + (" (in-sample)" if r["in_sample"] else "")
        lines.append(f"| {r['model']} | {r['np']} | {r['link']} | {r['compressor']} | {r['measured_ms']:.1f} | "
                     f"{r['predicted_ms']:.1f} | {err} | {r['codec_ms']:.1f} | {r['comm_ms']:.1f} |")
    lines += ["", "| model | P | link | measured fastest | its lead on the runner-up | predicted fastest | hit | near "
              "| measured pick / fastest |", "|---|---:|---|---|---:|---|---|---|---:|"]
    for p in picks:
        lines.append(f"| {p['model']} | {p['np']} | {p['link']} | {p['measured_fastest']} | {p['margin']:.0%} | "
                     f"{p['predicted_fastest']} | {'yes' if p['hit'] else 'no'} | {'yes' if p['near'] else 'no'} | "
                     f"{p['regret']:.2f} |")
    lines += ["", "Summary: " + summarize(rows, picks) + "."]
    return "\n".join(lines) + "\n"


def sensitivity(args):
    """The summary line under the other calibration choices, for comparison."""
    out = []
    for horovod in ("dense", "engine"):
        for contention in ("auto", "dense", "copy", "none"):
            for wire_source in ("measured", "formula"):
                alt = argparse.Namespace(**{**vars(args), "horovod": horovod, "contention": contention,
                                            "wire": wire_source})
                rows, picks, _, _ = validate(alt)
                out.append(f"- Horovod link `{horovod}`, contention `{contention}`, wire "
                           f"`{wire_source}`: {summarize(rows, picks)}")
    return "\n".join(["", "Sensitivity (engine link `" + args.calibrate + "`):"] + out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    rows, picks, calib, missing = validate(args)
    text = report(rows, picks, calib, missing, args) + sensitivity(args)
    print(text)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    if args.out:
        with open(args.out, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
            for p in picks:
                f.write(json.dumps(dict(p, kind="pick")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
