#!/usr/bin/env python3
"""The recipe study's tables (docs/results/accuracy.md): quality over seeds, and time to target
per link derived from one loopback study and ``bench_step``'s step times, checked against a
direct run on a link.

Quality does not depend on the link: at the same seed a run computes the same bits on any
link (the direct runs' curves are compared with the loopback ones to show it), so every
compressor trains once, on loopback, and a link changes only the time of a step. Time to
target on link L is then

    steps to target (the loopback run, seed 0) x the median step on L (bench_step: the same
    model, recipe and P, the steady step: no compression warm-up)

and a direct ``bench_tta`` run on L measures it once to check the derivation (its own
training seconds, whose first steps include the compression warm-up's dense steps). ``auto``
chooses by link: its derived row uses the step ``auto`` settled on in ``bench_step`` on that
link and the steps to target of its loopback run; its direct run is the measurement.

    python scripts/recipe_study.py --runs docs/results/data/accuracy/adamw*.jsonl \\
        --steps docs/results/data/accuracy/step-adamw.jsonl \\
        --direct docs/results/data/accuracy/adamw-1gbit.jsonl \\
        --md docs/results/accuracy.md --block study_adamw --tolerance 0.01

The target, as in ``bench_tta --tolerance``: Horovod dense's final metric (seed 0) made worse
by the tolerance (relative).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

import bench_tta  # noqa: E402  (scripts/, beside this file)
from doc_block import replace_block  # noqa: E402
from plot_step import link_key  # noqa: E402

DENSE, FP16 = bench_tta.DENSE, bench_tta.FP16
#: bench_tta's names of Horovod's own compressors -> bench_step's
STEP_NAME = {DENSE: "dense", FP16: "hvd-fp16"}


def read(paths, bench):
    """The records of ``bench`` ("tta" or "step") in ``paths``, in order."""
    return [r for path in paths for r in bench_tta.read_records(path) if r.get("bench") == bench]


def on_loss(recs):
    """The records with each evaluation's validation loss as their metric (lower is better): where
    the metric saturates (ResNet-18 on the digits: one test image is 0.28% of accuracy), the loss
    still tells runs apart."""
    return [dict(r, metric="validation loss", higher_is_better=False,
                 curve=[dict(p, metric=p.get("loss")) for p in r.get("curve") or []]) for r in recs]


def label(spec):
    return bench_tta.LABELS.get(spec, f"`{spec}`")


def higher_of(recs):
    """Whether a higher metric is better (:func:`bench_tta.metric_of`)."""
    return bench_tta.metric_of(recs)[1]


def target_of(recs, tolerance):
    """bench_tta's target (Horovod dense's final metric made worse by ``tolerance``) from the
    seed-0 runs, or None."""
    return bench_tta.target_of([r for r in recs if r.get("seed", 0) == 0], None, {}, tolerance)[0]


def by_run(recs):
    """OrderedDict compressor -> {seed: record} (the last record of each), in first-seen order
    with Horovod dense and fp16 first."""
    out = OrderedDict((name, {}) for name in (DENSE, FP16) if any(r["compressor"] == name for r in recs))
    for r in recs:
        out.setdefault(r["compressor"], {})[r.get("seed", 0)] = r
    return out


def relative(value, reference, higher):
    """How much worse ``value`` is than ``reference``, as a signed fraction of it (+: worse)."""
    return (reference - value) / reference if higher else (value - reference) / reference


def gaps_to_dense(recs):
    """{compressor: [its final metric's gap to Horovod dense's (:func:`relative`) at each seed
    both ran]}: the records' "vs dense, same seeds" is the mean of the list."""
    runs, higher = by_run(recs), higher_of(recs)
    dense = {s: bench_tta.final_metric(r) for s, r in runs.get(DENSE, {}).items()}
    gaps = OrderedDict()
    for name, per_seed in runs.items():
        finals = {s: bench_tta.final_metric(r) for s, r in per_seed.items()}
        gaps[name] = [relative(finals[s], dense[s], higher) for s in finals if finals[s] is not None and s in dense]
    return gaps


def seeds_table(recs, tolerance):
    """Final metric per seed, the mean gap to dense at the same seeds, and dense's seed spread."""
    runs, all_gaps = by_run(recs), gaps_to_dense(recs)
    seeds = sorted({s for per_seed in runs.values() for s in per_seed})
    dense = {s: bench_tta.final_metric(r) for s, r in runs.get(DENSE, {}).items()}
    lines = ["| run | " + " | ".join(f"seed {s}" for s in seeds) + " | vs dense, same seeds | within "
             f"{tolerance:.0%} of dense at every seed |",
             "|---|" + "---:|" * len(seeds) + "---:|---|"]
    for name, per_seed in runs.items():
        finals = {s: bench_tta.final_metric(r) for s, r in per_seed.items()}
        gaps = all_gaps[name]
        cells = [f"{finals[s]:.4g}" if finals.get(s) is not None else "" for s in seeds]
        gap = f"{100 * statistics.mean(gaps):+.2f}% ({len(gaps)} seed{'s' * (len(gaps) != 1)})" if gaps else ""
        within = "" if not gaps else "yes" if max(gaps) <= tolerance else "no"
        lines.append(f"| {label(name)} | " + " | ".join(cells) + f" | {gap} | {within} |")
    values = [v for v in dense.values() if v is not None]
    spread = (max(values) - min(values)) / statistics.mean(values) if len(values) > 1 else None
    note = (f"Horovod dense's seed-to-seed spread: {100 * spread:.2f}% ({len(values)} seeds, (max - min) / mean)."
            if spread is not None else "")
    return "\n".join(lines), note


def step_ms(step_recs):
    """{(link, bench_step compressor): median step ms} (the last record of each)."""
    return {(r["link"], r["compressor"]): r["total_ms"] for r in step_recs if r.get("total_ms") and not r.get("error")}


def reach_steps(recs, target):
    """{compressor: steps to target of its seed-0 run, or None (never)}."""
    higher = higher_of(recs)
    out = OrderedDict()
    for name, per_seed in by_run(recs).items():
        if 0 in per_seed:
            hit = bench_tta.first_reach(per_seed[0], target, higher)
            out[name] = hit and hit["step"]
    return out


def time_to_target(reach, times, name, link):
    """Derived seconds to target of run ``name`` on ``link``: its steps to target (``reach``,
    :func:`reach_steps`) x the link's median step (``times``, :func:`step_ms`); None where it
    never reached the target or the step was not timed."""
    steps, ms = reach.get(name), times.get((link, STEP_NAME.get(name, name)))
    return steps * ms / 1e3 if steps is not None and ms else None


def derived_table(recs, step_recs, target):
    """One table: per run, steps to target, then per link the step and the time to target, with
    the speed-up over Horovod dense and fp16 on the same link."""
    reach, times = reach_steps(recs, target), step_ms(step_recs)
    links = sorted({link for link, _ in times}, key=link_key)
    head = "| run | steps to target | " + " | ".join(f"{link}: step ms | time to target s | vs dense | vs fp16"
                                                     for link in links) + " |"
    lines = [head, "|---|---:|" + "---:|---:|---:|---:|" * len(links)]
    for name, steps in reach.items():
        if not any((link, STEP_NAME.get(name, name)) in times for link in links):
            continue  # a variant the step benchmark did not time
        cells = [str(steps) if steps is not None else "never"]
        for link in links:
            ms = times.get((link, STEP_NAME.get(name, name)))
            if ms is None:
                cells += ["", "", "", ""]
                continue
            seconds = time_to_target(reach, times, name, link)
            refs = [time_to_target(reach, times, ref, link) for ref in (DENSE, FP16)]
            ratios = [f"{ref / seconds:.2f}x" if seconds and ref else "" for ref in refs]
            cells += [f"{ms:.0f}", "never" if seconds is None else f"{seconds:.1f}"] + ratios
        lines.append(f"| {label(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def direct_table(direct, study, step_recs, tolerance):
    """Per direct run: its link, measured steps and seconds to target (its own dense's target, or
    the study's where no dense run went on that link),
    the derived seconds (its steps x bench_step's step on that link) and their ratio, and whether
    its curve equals the loopback run's of the same compressor and seed, value for value."""
    times, higher = step_ms(step_recs), higher_of(direct)
    loop = {(r["compressor"], r.get("seed", 0)): r for r in study}
    lines = ["| run | link | steps to target | measured s | derived s | derived / measured | same curve as loopback |",
             "|---|---|---:|---:|---:|---:|---|"]
    for link in sorted({r["link"] for r in direct}, key=link_key):
        here = [r for r in direct if r["link"] == link]
        target = target_of(here, tolerance)
        if target is None:
            target = target_of(study, tolerance)
        for r in here:
            hit = bench_tta.first_reach(r, target, higher) if target is not None else None
            ms = times.get((link, STEP_NAME.get(r["compressor"], r["compressor"])))
            derived = hit and ms and hit["step"] * ms / 1e3
            twin = loop.get((r["compressor"], r.get("seed", 0)))
            same = "" if twin is None else (
                "yes" if [p["metric"] for p in bench_tta.points(twin)] == [p["metric"] for p in bench_tta.points(r)]
                else "no")
            cells = [label(r["compressor"]), link, str(hit["step"]) if hit else "never",
                     f"{hit['seconds']:.1f}" if hit else "", f"{derived:.1f}" if derived else "",
                     f"{derived / hit['seconds']:.2f}" if derived and hit["seconds"] else "", same]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def commands(*groups):
    """The distinct driver commands of the records, in order."""
    return list(OrderedDict.fromkeys(r["driver_command"] for g in groups for r in g if r.get("driver_command")))


def markdown(study, step_recs, direct, tolerance):
    """The block: seeds, derived time to target per link, the direct check, the commands."""
    target = target_of(study, tolerance)
    if target is None:
        return "No Horovod dense run at seed 0 in the records: no target."
    seeds, spread = seeds_table(study, tolerance)
    ref = next(r for r in study if r["compressor"] == DENSE)
    timed = sorted({r.get("model") for r in step_recs} - {None, ref["workload"]})
    other = (f" (it timed {', '.join(timed)}: the same model, input shape and batch on other data)"
             if timed else "")
    out = [f"{ref['workload']} ({ref['params']:,} parameters in {ref['tensors']} tensors), "
           f"{bench_tta.recipe_text(ref)}, batch {ref['batch']} per rank, P = {ref['np']}, {ref['steps']} steps. "
           f"Target: {target:.4g}, Horovod dense's final {ref['metric']} at seed 0 within {tolerance:.0%}.", "",
           f"Final {ref['metric']} per seed (loopback):", "", seeds, "", spread, "",
           "Time to target per link, derived (steps to target at seed 0 x the link's median step, "
           f"from `bench_step` with the same model and optimizer{other}):", "",
           derived_table(study, step_recs, target), ""]
    if direct:
        out += ["Direct runs on an emulated link, against the derivation:", "",
                direct_table(direct, study, step_recs, tolerance), ""]
    out += ["Commands:", ""] + [f"- `{c}`" for c in commands(study, step_recs, direct)]
    return "\n".join(out)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", required=True, help="bench_tta records of the loopback study (any seeds)")
    p.add_argument("--steps", nargs="+", required=True, help="bench_step records: the same model and --recipe")
    p.add_argument("--direct", nargs="*", default=[], help="bench_tta records of direct runs on emulated links")
    p.add_argument("--tolerance", type=float, default=0.01, help="the target's tolerance (default 0.01)")
    p.add_argument("--loss", action="store_true",
                   help="read each evaluation's validation loss instead of the workload's metric")
    p.add_argument("--md", default=None, help="page whose --block is rewritten (default: print)")
    p.add_argument("--block", default="study", help="the generated block's name (default study)")
    return p


def main(argv=None):
    a = build_parser().parse_args(argv)
    study, direct = [r for r in read(a.runs, "tta") if r["link"] == "loopback"], read(a.direct, "tta")
    if a.loss:
        study, direct = on_loss(study), on_loss(direct)
    text = markdown(study, read(a.steps, "step"), direct, a.tolerance)
    if a.md:
        replace_block(a.md, a.block, text)
        print(f"[recipe_study] {len(study)} runs -> {a.md} ({a.block})")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
