#!/usr/bin/env python3
"""The step-time tables of docs/results/auto.md: ``Compression.auto`` beside every fixed compressor
measured in the same run (records of ``scripts/bench_step.py``), with its two target ratios.

    python scripts/auto_report.py docs/results/data/auto/step.jsonl            # rewrite the block of docs/results/auto.md
    python scripts/auto_report.py results/auto-step-p2.jsonl --print   # print it, change nothing

Per model, link and P: each run's median step (forward + backward + ``opt.step()``, slowest
rank) and speed-up over Horovod dense; then ``auto`` against the fastest fixed compressor
and against the faster of Horovod dense and fp16, and what ``auto`` chose in each round.
"""
import argparse
import json
import os
import sys
from collections import OrderedDict

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "scripts")]

from doc_block import replace_block  # noqa: E402

BLOCK = "auto-step"
DENSE_BASELINES = ("dense", "hvd-fp16")


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def cells(records):
    """``{(model, link, np): {compressor: record}}``, the last record of each kept."""
    out = OrderedDict()
    for r in records:
        out.setdefault((r["model"], r["link"], r["np"]), OrderedDict())[r["compressor"]] = r
    return out


def ratio(a, b):
    return None if not a or not b else a / b


def markdown(records):
    lines = []
    summary = ["| model | link | P | auto (ms) | fastest fixed | its ms | auto / fastest fixed | "
               "auto / min(dense, fp16) | auto chose (per round) |", "|---|---|---:|---:|---|---:|---:|---:|---|"]
    for (model, link, np_), runs in cells(records).items():
        auto = runs.get("auto")
        fixed = {c: r for c, r in runs.items() if c != "auto" and r.get("total_ms")}
        lines += [f"#### {model}, {link}, P = {np_}", "",
                  "| run | step (ms) | vs Horovod dense | identical replicas |", "|---|---:|---:|---|"]
        for c, r in runs.items():
            ms = "failed: " + str(r["error"])[:80] if r.get("error") else f"{r['total_ms']:.0f}"
            vs = "" if not r.get("vs_dense") else f"{r['vs_dense']:.2f}x"
            lines.append(f"| {c} | {ms} | {vs} | {'yes' if r.get('replicas_identical') else 'no'} |")
        lines.append("")
        if auto is None or not auto.get("total_ms") or not fixed:
            continue
        best = min(fixed, key=lambda c: fixed[c]["total_ms"])
        baseline = min((fixed[c]["total_ms"] for c in DENSE_BASELINES if c in fixed), default=None)
        chose = "; ".join(f"{a['chosen']}" for a in auto.get("auto") or [])
        summary.append(f"| {model} | {link} | {np_} | {auto['total_ms']:.0f} | {best} | {fixed[best]['total_ms']:.0f} | "
                       f"{ratio(auto['total_ms'], fixed[best]['total_ms']):.2f} | "
                       f"{ratio(auto['total_ms'], baseline):.2f} | {chose} |")
    note = ("Ratios are of median step times measured in the same run (below 1: auto is faster). "
            "Targets: auto / fastest fixed <= 1.05 in every cell; auto / min(dense, fp16) <= 1.03 on loopback.")
    return "\n".join(summary + ["", note, ""] + lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", help="bench_step records (JSON lines)")
    p.add_argument("--md", default=os.path.join(REPO, "docs", "results", "auto.md"))
    p.add_argument("--print", action="store_true", help="print the block, change nothing")
    a = p.parse_args(argv)
    records = [r for path in a.data for r in load(path)]
    text = markdown(records)
    if a.print:
        print(text)
    else:
        replace_block(a.md, BLOCK, text)
        print(f"[auto_report] {len(records)} records -> {a.md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
