#!/usr/bin/env python3
"""Time to accuracy of docs/results/accuracy.md: every compressor and the DDP peers train each real
workload from the same initial model with the same hyper-parameters, on each link; the report
says how soon each reaches the quality Horovod's dense reaches at the end of its budget.

    python scripts/bench_tta.py                              # the full study (root, for netem)
    python scripts/bench_tta.py --dry-run                    # print the commands, run nothing
    python scripts/bench_tta.py --smoke                      # one minute: loopback, P=2, 3 runs
    python scripts/bench_tta.py --report                     # only regenerate the doc

One job per (workload, link): ``scripts/netem.py --rate R -np N -- python -m
horovod_sparse.bench.tta ...`` (``loopback`` is ``--rate none``: mpirun over TCP on lo), one
thread per rank, ranks that yield while waiting in MPI. The ranks append one record per run
to ``--out`` (emptied first). A job that dies in a run (a crash, ``--timeout``) gets a
failure record for that run from here, and the runs after it start again in a new job. When
the jobs are done the records are copied to ``--data`` and the report is written from it.

The report, per workload, link and P: the target (``--target``, else Horovod dense's final
metric), and per run the final metric, the steps and training seconds to the target (read at
the evaluation points; "never" with the best metric where it is not reached), the speed-up
in time to target over Horovod dense and over Horovod fp16, and failures with their error;
into the ``tta`` block of ``--md``, with one plot per workload and link (metric against
training seconds, every run on it) beside it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

from horovod_sparse.bench import step, tta  # noqa: E402  (stdlib only at import)
from doc_block import replace_block  # noqa: E402
from plot_step import link_key  # noqa: E402
from bench_step import MPIRUN_ARGS, RANK_ENV, default_python, run_job  # noqa: E402,F401  (run_job: tests patch it here)

BLOCK = "tta"
DENSE, FP16 = "hvd-none", "hvd-fp16"
LABELS = {"hvd-none": "Horovod dense (none)", "hvd-fp16": "Horovod fp16", "ddp-none": "DDP dense (gloo)",
          "ddp-fp16": "DDP fp16_compress_hook", "ddp-powersgd": "DDP powerSGD_hook, rank 1"}
#: the workloads of the page's time-to-accuracy tables (cluttered_resnet is the recipe study's, --workloads)
DEFAULT_WORKLOADS = ("digits_resnet", "stdlib_lm")
#: The smoke mode: ResNet-18 on loopback, P=2, Horovod's dense, one of ours and one DDP peer.
SMOKE = ["--workloads", "digits_resnet", "--links", "loopback", "--np", "2",
         "--compressors", "hvd-none", "topk:density=0.01", "ddp-fp16",
         "--steps", "4", "--eval-every", "2", "--batch", "8",
         "--timeout", "300", "--run-timeout", "150", "--ddp-timeout", "60"]


def build_parser():
    p = argparse.ArgumentParser(prog="bench_tta.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", default=list(DEFAULT_WORKLOADS), choices=tta.NAMES,
                   help="default: %(default)s")
    p.add_argument("--links", nargs="+", default=["loopback", "1gbit", "10gbit"],
                   help="tc rates per rank link, or loopback (default: loopback 1gbit 10gbit)")
    p.add_argument("--np", type=int, default=2, help="MPI ranks (default 2)")
    p.add_argument("--compressors", nargs="+", default=list(tta.DEFAULT_COMPRESSORS), metavar="SPEC",
                   help="hvd-none, hvd-fp16, ddp-none, ddp-fp16, ddp-powersgd, or horovod_sparse specs "
                        "(default: %(default)s)")
    p.add_argument("--steps", type=int, default=300, help="step budget per run (default 300; 0: none)")
    p.add_argument("--seconds", type=float, default=None, help="training-seconds budget per run")
    p.add_argument("--eval-every", type=int, default=20, help="steps between evaluations (default 20)")
    p.add_argument("--batch", type=int, default=None, help="batch per rank (default: the workload's)")
    p.add_argument("--recipe", default=None, type=tta.recipe_spec,
                   help="optimizer and schedule (default: each workload's own)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--model", default=None, metavar="KEY=INT,...",
                   help="the language model's size, e.g. layers=4,d_model=256,heads=4")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--target", nargs="+", default=[], metavar="[WORKLOAD=]VALUE",
                   help="the target metric, for every workload or per workload (default: Horovod "
                        "dense's final metric in each workload and link)")
    p.add_argument("--tolerance", type=float, default=0.0, metavar="REL",
                   help="with the default target: dense's final metric made worse by this fraction "
                        "of it (0.01: within 1%% relative of dense, the accuracy study's quality bar; default 0)")
    p.add_argument("--out", default="results/tta.jsonl", help="records of this run (emptied first)")
    p.add_argument("--data", default="docs/results/accuracy.jsonl",
                   help="where the records are kept for the doc (copied from --out after the run)")
    p.add_argument("--md", default="docs/results/accuracy.md", help="doc whose tta block is regenerated")
    p.add_argument("--block", default=BLOCK,
                   help="the generated block of --md to write (default %(default)s; another block's plots "
                        "are named after it too)")
    p.add_argument("--report", nargs="?", const="", default=None, metavar="MD",
                   help="run nothing: regenerate MD (default --md) and its plots from --data")
    p.add_argument("--no-doc", action="store_true", help="run and keep --out only; leave docs/ alone")
    p.add_argument("--note", default="", help="free text stored in each record")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds per job (default 6 h)")
    p.add_argument("--run-timeout", type=float, default=3600,
                   help="seconds one run may take inside a job (default 3600)")
    p.add_argument("--ddp-timeout", type=float, default=300, help="gloo's timeout per collective (default 300)")
    p.add_argument("--python", default=default_python(), help="python of the ranks (default: .venv's)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    p.add_argument("--smoke", action="store_true",
                   help="a one-minute run (loopback, P=2, 3 runs, 4 steps) into a temporary folder, "
                        "and a check of its records and report")
    return p


def parse_targets(items):
    """``["0.9"]`` -> ``{None: 0.9}``; ``["stdlib_lm=2.5"]`` -> ``{"stdlib_lm": 2.5}``."""
    targets = {}
    for item in items:
        name, _, value = item.rpartition("=")
        if name and name not in tta.NAMES:
            raise ValueError(f"--target {item}: unknown workload {name!r}")
        targets[name or None] = float(value)
    return targets


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.links = [step._link(link) for link in a.links]
        a.targets = parse_targets(a.target)
        if not 0 <= a.tolerance < 1:
            raise ValueError(f"--tolerance must be in [0, 1), got {a.tolerance}")
    except (argparse.ArgumentTypeError, ValueError) as e:
        p.error(str(e))
    a.steps = a.steps or None
    if a.np < 1 or a.eval_every < 1 or (a.steps or 0) < 0 or (a.steps is None and a.seconds is None):
        p.error("need --np >= 1, --eval-every >= 1 and a budget (--steps and/or --seconds)")
    if a.report is not None:
        a.md = a.report or a.md
    return a


# ----------------------------------------------------------------------------- the jobs
def started_path(a):
    return a.out + ".started"


def job_command(a, workload, link, compressors):
    """The netem.py command line of one (workload, link) job."""
    rate = "none" if link == "loopback" else link
    bench = [a.python, "-m", "horovod_sparse.bench.tta", "--workload", workload, "--compressors", *compressors,
             "--link", link, "--eval-every", str(a.eval_every), "--seed", str(a.seed), "--out", a.out,
             "--started", started_path(a), "--timeout", str(a.run_timeout), "--ddp-timeout", str(a.ddp_timeout)]
    for flag, value in (("--steps", a.steps), ("--seconds", a.seconds), ("--batch", a.batch),
                        ("--recipe", a.recipe), ("--lr", a.lr), ("--model", a.model)):
        if value is not None:
            bench += [flag, str(value)]
    if a.note:
        bench += ["--note", a.note]
    # "--mpirun-args=...": with a space argparse would read the value, which starts with "--", as an option
    return [a.python, os.path.join("scripts", "netem.py"), "--rate", rate, "-np", str(a.np),
            f"--mpirun-args={MPIRUN_ARGS}", "--"] + bench


def read_records(path, offset=0):
    """The JSON records of ``path`` from byte ``offset`` on."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        f.seek(offset)
        return [json.loads(line) for line in f if line.strip()]


def failure_record(a, workload, link, spec, error):
    """What the driver writes for a run that left no record of its own."""
    return {"bench": "tta", "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "workload": workload,
            "metric": None, "higher_is_better": None, "compressor": spec, "kind": tta.kind_of(spec),
            "np": a.np, "link": link, "budget_steps": a.steps, "budget_seconds": a.seconds,
            "eval_every": a.eval_every, "curve": [], "steps": 0, "seconds": 0.0,
            "replicas_identical": None, "error": error, "note": a.note,
            "driver_command": os.environ.get(step.DRIVER_ENV)}


def run_workload_link(a, workload, link, env):
    """Every run of one (workload, link), in as many jobs as it takes. Returns True if all ran."""
    remaining, clean = list(a.compressors), True
    while remaining:
        argv = job_command(a, workload, link, remaining)
        print(f"[bench_tta] === {workload}, link {link}, P={a.np}: {shlex.join(argv)}", flush=True)
        if a.dry_run:
            return True
        offset = os.path.getsize(a.out)
        if os.path.exists(started_path(a)):
            os.remove(started_path(a))
        rc, timed_out = run_job(argv, env, a.timeout)
        done = {r["compressor"] for r in read_records(a.out, offset)}
        left = [c for c in remaining if c not in done]
        if rc == 0 and not left:
            return clean
        clean = False
        started = open(started_path(a)).read().strip() if os.path.exists(started_path(a)) else None
        why = f"timeout after {a.timeout:.0f} s" if timed_out else f"exit status {rc}"
        if started is None:   # no run began: the job itself could not start
            print(f"[bench_tta] !!! {workload} {link}: the job failed before its first run ({why})", flush=True)
            missing = [failure_record(a, workload, link, c, f"not run: the job failed before it ({why})")
                       for c in left]
        elif started not in done:   # died inside a run: say so, then go on with the next ones
            print(f"[bench_tta] !!! {workload} {link}: the job died in {started} ({why}); "
                  "going on with the runs after it", flush=True)
            missing = [failure_record(a, workload, link, started,
                                      f"the job died during this run ({why}); no record of its own")]
        else:   # stopped after a run that says why in its record
            missing = []
        with open(a.out, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in missing)
        remaining = [c for c in left if c != started] if started is not None else []
    return clean


# ----------------------------------------------------------------------------- the report
def load(paths):
    """Records of every file, the last one per (workload, link, np, compressor), in first-seen order."""
    recs = OrderedDict()
    for path in paths:
        for r in read_records(path):
            if r.get("bench") == "tta":
                recs[(r["workload"], r["link"], r["np"], r["compressor"])] = r
    return list(recs.values())


def order_key(spec):
    """The default compressor order, then the others by name."""
    order = list(tta.DEFAULT_COMPRESSORS)
    return (order.index(spec), spec) if spec in order else (len(order), spec)


def groups(recs):
    """OrderedDict (workload, link, np) -> records: workloads in first-seen order, links
    loopback first then fastest to slowest, runs in the default compressor order."""
    out = OrderedDict()
    seen = list(OrderedDict.fromkeys(r["workload"] for r in recs))
    for r in sorted(recs, key=lambda r: (seen.index(r["workload"]), link_key(r["link"]), r["np"])):
        out.setdefault((r["workload"], r["link"], r["np"]), []).append(r)
    for rs in out.values():
        rs.sort(key=lambda r: order_key(r["compressor"]))
    return out


def metric_of(rs):
    """(metric name, higher is better) of a group, from any record that has them."""
    r = next((r for r in rs if r.get("metric")), None)
    return (r["metric"], r["higher_is_better"]) if r else ("metric", True)


def points(rec):
    """The curve points that have a metric (a diverged evaluation has none)."""
    return [p for p in rec.get("curve") or [] if p.get("metric") is not None]


def final_metric(rec):
    pts = points(rec)
    return pts[-1]["metric"] if pts else None


def best_metric(rec, higher):
    values = [p["metric"] for p in points(rec)]
    return (max if higher else min)(values) if values else None


def first_reach(rec, target, higher):
    """The first curve point after some training at or past ``target``, or None (the initial
    model, the same for every run, does not count)."""
    for p in points(rec):
        if p["step"] > 0 and ((p["metric"] >= target) if higher else (p["metric"] <= target)):
            return p
    return None


def target_of(rs, workload, targets, tolerance=0.0):
    """(target, where it comes from) of one group: ``targets`` (per workload, or None: for
    all), else Horovod dense's final metric made worse by ``tolerance`` of it (relative);
    (None, why) when neither exists."""
    for key in (workload, None):
        if key in targets:
            return targets[key], "given (--target)"
    dense = next((r for r in rs if r["compressor"] == DENSE), None)
    if dense is None or dense.get("error") or final_metric(dense) is None:
        return None, "no target: Horovod dense has no complete run here"
    final = final_metric(dense)
    higher = dense.get("higher_is_better", True)
    source = f"Horovod dense's final {dense['metric']} ({dense['steps']} steps, {dense['seconds']:.1f} s of training)"
    if tolerance:
        source = f"within {100 * tolerance:g}% (relative) of {source}, {_metric(final)}"
    return final * (1 - tolerance if higher else 1 + tolerance), source


def summarise(rs, target, higher):
    """One row per run: final and best metric, steps and seconds to ``target``, speed-ups."""
    reach = {r["compressor"]: (first_reach(r, target, higher) if target is not None else None) for r in rs}
    base = {name: reach.get(name) for name in (DENSE, FP16)}
    rows = []
    for r in rs:
        hit = reach[r["compressor"]]
        row = {"compressor": r["compressor"], "steps": r.get("steps"), "seconds": r.get("seconds"),
               "final": final_metric(r), "best": best_metric(r, higher), "error": r.get("error"),
               "identical": r.get("replicas_identical"), "reach_step": hit and hit["step"],
               "reach_seconds": hit and hit["seconds"]}
        for name, key in ((DENSE, "vs_dense"), (FP16, "vs_fp16")):
            other = base[name]
            row[key] = (other["seconds"] / hit["seconds"] if hit and other and hit["seconds"] > 0 else None)
        rows.append(row)
    return rows


def _metric(v):
    return "" if v is None else f"{v:.4g}"


def _times(v):
    return "" if v is None else f"{v:.2f}x"


def table(rows, metric, target):
    lines = [f"| run | steps | training s | final {metric} | steps to target | time to target (s) "
             "| vs Horovod dense | vs Horovod fp16 | replicas identical |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        name = LABELS.get(row["compressor"], row["compressor"])
        if row["reach_step"] is not None:
            to_step, to_time = str(row["reach_step"]), f"{row['reach_seconds']:.1f}"
        elif target is None or row["best"] is None:
            to_step = to_time = ""
        else:
            to_step, to_time = f"never (best {_metric(row['best'])})", "never"
        ident = {True: "yes", False: "NO", None: ""}[row["identical"]]
        if row["error"]:
            ident = "failed: " + row["error"].replace("|", "/")
        seconds = "" if not row["steps"] else f"{row['seconds']:.1f}"
        cells = [name, str(row["steps"] or ""), seconds, _metric(row["final"]), to_step, to_time,
                 _times(row["vs_dense"]), _times(row["vs_fp16"]), ident]
        lines.append("|" + "|".join(f" {c} " if c else " " for c in cells) + "|")
    return "\n".join(lines)


def png_name(workload, link, np_, page="accuracy"):
    """The plot of one group beside ``page`` (the doc's name without .md)."""
    return f"{page}_{workload}_{link}_p{np_}.png"


def markdown(recs, targets=None, png_dir=None, tolerance=0.0, page="accuracy"):
    """The tta block: one section per (workload, link, np), each with its plot where
    ``png_dir`` (relative to the page) is given."""
    targets = targets or {}
    if not recs:
        return "No records yet: run `python scripts/bench_tta.py` (see above)."
    commands = list(OrderedDict.fromkeys(r["driver_command"] for r in recs if r.get("driver_command")))
    days = sorted({r["timestamp"][:10] for r in recs if r.get("timestamp")})
    out = [f"Measured {' to '.join(dict.fromkeys([days[0], days[-1]])) if days else ''} with "
           + ("; ".join(f"`{c}`" for c in commands) or "`python -m horovod_sparse.bench.tta`")
           + ". Time to target is read at the evaluation points, so it is as coarse as the "
           "evaluation interval; training seconds leave the evaluations out.", ""]
    for (workload, link, np_), rs in groups(recs).items():
        metric, higher = metric_of(rs)
        target, source = target_of(rs, workload, targets, tolerance)
        ref = next((r for r in rs if r.get("lr") is not None), rs[0])
        out += [f"### {workload}, {link}, P = {np_}", ""]
        budget = " or ".join(f"{v:g} {unit}" for v, unit in ((ref.get("budget_steps"), "steps"),
                                                             (ref.get("budget_seconds"), "s of training"))
                             if v is not None)
        settings = (f"{recipe_text(ref)}, batch {ref.get('batch')} per rank, "
                    f"budget {budget}, evaluation every {ref.get('eval_every')} steps")
        aim = f"target {_metric(target)} = {source}" if target is not None else source
        out += [f"{metric} ({'higher' if higher else 'lower'} is better); {aim}. {settings}.", ""]
        if png_dir is not None:
            out += [f"![{metric} against training seconds]({os.path.join(png_dir, png_name(workload, link, np_, page))})",
                    ""]
        out += [table(summarise(rs, target, higher), metric, target), ""]
    return "\n".join(out)


def recipe_text(record):
    """The record's optimizer and schedule in a few words (records before recipes ran plain SGD)."""
    r = record.get("recipe") or {"name": "sgd", "lr": record.get("lr"), "momentum": record.get("momentum")}
    words = {"sgd": "SGD", "momentum": "SGD", "adamw": "AdamW",
             "adamw-exact": "horovod_sparse.torch.AdamW",
             # records made before recipes took options: adamw-exact:exact_compression=fp16
             "adamw-exact-fp16": "horovod_sparse.torch.AdamW exact_compression=fp16"}[r["name"]]
    words += "".join(f" {name}={value}" for name, value in r.get("options", ()))
    words += f" lr {r.get('lr')}"
    if r.get("momentum"):
        words += f" momentum {r['momentum']}"
    if r.get("weight_decay"):
        words += f" weight decay {r['weight_decay']}"
    if r.get("warmup"):
        words += f", {r['warmup']:.0%} warm-up"
    if r.get("decay", "constant") != "constant":
        words += f", {r['decay']} decay"
    return words


def plot(rs, target, path, title):
    """Metric against training seconds, one line per run, the target dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    metric, _ = metric_of(rs)
    fig, ax = plt.subplots(figsize=(8, 5))
    colours = plt.get_cmap("tab20").colors[::2] + plt.get_cmap("tab20").colors[1::2]
    for i, r in enumerate(rs):
        pts = points(r)
        if not pts:
            continue
        style = {"horovod": "-", "ddp": ":", "ours": "-"}.get(r.get("kind"), "-")
        label = LABELS.get(r["compressor"], r["compressor"]) + (" (failed)" if r.get("error") else "")
        ax.plot([p["seconds"] for p in pts], [p["metric"] for p in pts], style, marker=".",
                color=colours[i % len(colours)], lw=2.2 if r.get("kind") == "horovod" else 1.3, label=label)
    if target is not None:
        ax.axhline(target, color="grey", ls="--", lw=1, label=f"target {_metric(target)}")
    ax.set_xlabel("training seconds (evaluations left out)")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(recs, md, targets=None, tolerance=0.0, block=BLOCK):
    """The ``block`` of ``md`` and one plot per group beside it; returns the plot paths. The
    plots are named after the page, and after the block too where it is not the tta block."""
    folder = os.path.dirname(os.path.abspath(md))
    page = os.path.splitext(os.path.basename(md))[0] + ("" if block == BLOCK else f"_{block}")
    os.makedirs(folder, exist_ok=True)
    pngs = []
    for (workload, link, np_), rs in groups(recs).items():
        target, _ = target_of(rs, workload, targets or {}, tolerance)
        pngs.append(os.path.join(folder, png_name(workload, link, np_, page)))
        plot(rs, target, pngs[-1], f"{workload}, {link}, P = {np_}")
    replace_block(md, block, markdown(recs, targets, png_dir="", tolerance=tolerance, page=page),
                  heading="## Results\n")
    return pngs


def report(a):
    if not os.path.exists(a.data):
        print(f"[bench_tta] no records in {a.data}", flush=True)
        return 1
    recs = load([a.data])
    pngs = write_report(recs, a.md, a.targets, a.tolerance, a.block)
    print(f"[bench_tta] {len(recs)} records from {a.data} -> {a.md}, {len(pngs)} plots", flush=True)
    return 0


# ------------------------------------------------------------------------------ the smoke
def check_smoke(recs, compressors, steps, eval_every):
    """What must hold of the smoke's records; returns the problems found."""
    problems = []
    by_name = {r["compressor"]: r for r in recs}
    expected = list(range(0, steps, eval_every)) + [steps]
    for spec in compressors:
        r = by_name.get(spec)
        if r is None:
            problems.append(f"{spec}: no record")
            continue
        if r.get("error"):
            problems.append(f"{spec}: {r['error']}")
        if r.get("replicas_identical") is not True:
            problems.append(f"{spec}: replicas_identical is {r.get('replicas_identical')}")
        curve = r.get("curve") or []
        if [p["step"] for p in curve] != expected:
            problems.append(f"{spec}: evaluated at steps {[p['step'] for p in curve]}, expected {expected}")
        seconds = [p["seconds"] for p in curve]
        if seconds != sorted(seconds) or (len(seconds) > 1 and not seconds[-1] > 0):
            problems.append(f"{spec}: training seconds {seconds} do not grow")
        if any(p["metric"] is None or not math.isfinite(p["metric"]) for p in curve):
            problems.append(f"{spec}: a metric is missing or not finite")
    return problems


def smoke(a):
    folder = tempfile.mkdtemp(prefix="tta-smoke-")
    out, md = os.path.join(folder, "tta.jsonl"), os.path.join(folder, "accuracy.md")
    s = parse_args(SMOKE + ["--out", out, "--no-doc", "--python", a.python])
    start = time.monotonic()
    rc = run(s)
    recs = load([out])
    problems = check_smoke(recs, s.compressors, s.steps, s.eval_every)
    if rc != 0:
        problems.append(f"the run exited with status {rc}")
    if recs:
        pngs = write_report(recs, md)
        text = open(md).read()
        problems += [f"report: no row for {c}" for c in s.compressors if f"| {LABELS.get(c, c)} |" not in text]
        problems += [f"report: no plot {p}" for p in pngs if not os.path.getsize(p)]
    took = time.monotonic() - start
    if problems:
        print(f"[bench_tta] smoke FAILED after {took:.0f} s (records, report in {folder}):\n  "
              + "\n  ".join(problems), flush=True)
        return 1
    shutil.rmtree(folder, ignore_errors=True)
    print(f"[bench_tta] smoke ok in {took:.0f} s: {len(recs)} runs, replicas identical, report written",
          flush=True)
    return 0


# ----------------------------------------------------------------------------------- main
def run(a, cmdline=None):
    """Every (workload, link) job; then the report unless --dry-run or --no-doc."""
    env = {**os.environ, **RANK_ENV, step.DRIVER_ENV: cmdline or "python scripts/bench_tta.py"}
    if not a.dry_run:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        open(a.out, "w").close()
    failed, start = [], time.monotonic()
    for workload in a.workloads:
        for link in a.links:
            if not run_workload_link(a, workload, link, env):
                failed.append(f"{workload}/{link}")
    if os.path.exists(started_path(a)):
        os.remove(started_path(a))
    print(f"[bench_tta] done in {time.monotonic() - start:.0f} s"
          + (f"; with failures: {' '.join(failed)}" if failed else ""), flush=True)
    if a.dry_run or a.no_doc:
        return 1 if failed else 0
    if os.path.getsize(a.out):
        os.makedirs(os.path.dirname(os.path.abspath(a.data)), exist_ok=True)
        shutil.copyfile(a.out, a.data)
        report(a)
    return 1 if failed else 0


def main(argv=None):
    a = parse_args(argv)
    os.chdir(REPO)
    if a.report is not None:
        return report(a)
    if a.smoke:
        return smoke(a)
    return run(a, shlex.join(["python", "scripts/bench_tta.py"] + (sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
