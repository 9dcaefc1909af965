#!/usr/bin/env python3
"""Turn bench_exchange.py JSON lines into a plot and the tables of docs/results/benchmarks.md.

    python scripts/plot_benchmarks.py docs/results/benchmarks.jsonl --png docs/results/benchmarks.png \
        --update-md docs/results/benchmarks.md

The PNG has one panel per link rate: median time per call (log scale, bars from
min to max of the repeats) of each algorithm against the number of ranks P.
With --update-md the text between ``<!-- results:begin -->`` and
``<!-- results:end -->`` in that file is replaced by one table per link rate
(medians, bytes sent per rank, theory), each preceded by the commands that
produced its rows. When several records share (n, density, rate, P, algorithm)
the last one read wins.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections import OrderedDict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from doc_block import replace_block  # noqa: E402
ALGO_ORDER = ["dense", "allgather", "oktopk", "gtopk", "dsa"]
ALGO_LABEL = {"dense": "dense (MPI Allreduce)", "allgather": "TopkA (allgather)",
              "oktopk": "Ok-Topk", "gtopk": "gTop-k", "dsa": "TopkDSA"}
THEORY_TEXT = {"dense": "2n(P-1)/P", "allgather": "2k(P-1)", "oktopk": "2k(P-1)/P .. 6k(P-1)/P",
               "gtopk": "4k log2 P", "dsa": "4k(P-1)/P .. (2k+n)(P-1)/P"}
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def rate_key(rate: str):
    """Sort rates slowest first, loopback / unknown last."""
    m = re.match(r"^(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)$", rate.lower())
    if not m:
        return (1, float("inf"), rate)
    v = float(m.group(1)) * _UNIT[m.group(2)] * (8 if m.group(3) == "bps" else 1)
    return (0, v, rate)


def algo_key(a):
    return (ALGO_ORDER.index(a) if a in ALGO_ORDER else len(ALGO_ORDER), a)


def load(paths, n=None, density=None):
    recs = OrderedDict()
    for path in paths:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                r = json.loads(line)
                if (n is not None and r["n"] != n) or (density is not None and r["density"] != density):
                    continue
                recs[(r["n"], r["density"], r["rate"], r["P"], r["algorithm"])] = r
    return list(recs.values())


def plot(recs, png, title=None):
    rates = sorted({r["rate"] for r in recs}, key=rate_key)
    fig, axes = plt.subplots(1, len(rates), figsize=(4.6 * len(rates), 4.2), squeeze=False,
                             sharey=True)
    for ax, rate in zip(axes[0], rates):
        sub = [r for r in recs if r["rate"] == rate]
        for algo in sorted({r["algorithm"] for r in sub}, key=algo_key):
            pts = sorted((r for r in sub if r["algorithm"] == algo), key=lambda r: r["P"])
            Ps = [r["P"] for r in pts]
            med = [r["median_s"] for r in pts]
            err = [[r["median_s"] - r["min_s"] for r in pts], [r["max_s"] - r["median_s"] for r in pts]]
            ax.errorbar(Ps, med, yerr=err, marker="o", capsize=3, label=ALGO_LABEL.get(algo, algo))
        ax.set_title("loopback (TCP over lo)" if rate == "loopback" else f"{rate} per rank link")
        ax.set_xlabel("ranks P")
        ax.set_xticks(sorted({r["P"] for r in sub}))
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("time per allreduce call, s (median; bars: min..max)")
    axes[0][-1].legend(fontsize=8)
    if title is None and recs:
        r0 = recs[0]
        title = (f"sparse allreduce of n = {r0['n']:,} float32, density {r0['density']} "
                 f"(k = {r0['k']:,} per rank); 2-core VM, ranks oversubscribed")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def _mb(b):
    return f"{b / 1e6:.2f}"


def launch_command(r):
    rate = "none" if r["rate"] == "loopback" else r["rate"]
    return f"python scripts/netem.py --rate {rate} -np {r['P']} -- python {r['command']}"


def summary(recs):
    """Per rate and P: dense, TopkA and Ok-Topk side by side, with speed-ups and bytes."""
    out = ["### Summary: Ok-Topk against dense and TopkA\n",
           "Generated from the tables below (same runs). Speed-up = median time of the other "
           "algorithm / median time of Ok-Topk; MB = bytes sent per rank per call (max over ranks).\n",
           "| link | P | dense s | TopkA s | Ok-Topk s | Ok-Topk vs dense | Ok-Topk vs TopkA "
           "| Ok-Topk MB | 6k(P-1)/P bound MB | TopkA MB | dense MB |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["rate"], r["P"], r["algorithm"]): r for r in recs}
    for rate in sorted({r["rate"] for r in recs}, key=rate_key):
        for P in sorted({r["P"] for r in recs if r["rate"] == rate}):
            d, a, o = (by.get((rate, P, x)) for x in ("dense", "allgather", "oktopk"))
            if o is None:
                continue
            t = lambda r: f"{r['median_s']:.3f}" if r else "-"
            mb = lambda r: _mb(r["bytes_sent_per_rank_max"]) if r else "-"
            sp = lambda r: f"{r['median_s'] / o['median_s']:.1f}x" if r else "-"
            out.append(f"| {rate} | {P} | {t(d)} | {t(a)} | {t(o)} | {sp(d)} | {sp(a)} | {mb(o)} "
                       f"| {_mb(o['theory_bytes_high'])} | {mb(a)} | {mb(d)} |")
    return "\n".join(out) + "\n"


def markdown(recs):
    out = [summary(recs)]
    for rate in sorted({r["rate"] for r in recs}, key=rate_key):
        sub = sorted((r for r in recs if r["rate"] == rate), key=lambda r: (r["P"], algo_key(r["algorithm"])))
        r0 = sub[0]
        head = "loopback (TCP over `lo`, no shaping)" if rate == "loopback" else f"{rate} per rank link (tbf)"
        out.append(f"### {head}\n")
        out.append(f"n = {r0['n']:,} float32, density {r0['density']} (k = {r0['k']:,} per rank), "
                   f"{r0['warmup']} warm-up + {r0['repeats']} timed calls; time = median over the timed "
                   f"calls of the slowest rank's time. Commands (from the repo root):\n")
        out.append("```")
        for cmd in OrderedDict.fromkeys(launch_command(r) for r in sub):
            out.append(cmd)
        out.append("```\n")
        out.append("| P | algorithm | median s | min s | max s | sent MB/rank (max) "
                   "| theory MB/rank | sent / theory | msgs/rank |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in sub:
            lo, hi = r["theory_bytes_low"], r["theory_bytes_high"]
            th = _mb(lo) if lo == hi else f"{_mb(lo)} .. {_mb(hi)}"
            sent = r["bytes_sent_per_rank_max"]
            ratio = f"{sent / hi:.2f}" if hi else "-"
            if lo != hi and hi:
                ratio = f"{sent / lo:.2f} of low, {sent / hi:.2f} of high"
            src = "" if r.get("traffic_source", "engine") == "engine" else " (model)"
            out.append(f"| {r['P']} | {r['algorithm']} | {r['median_s']:.3f} | {r['min_s']:.3f} "
                       f"| {r['max_s']:.3f} | {_mb(sent)}{src} | {th} | {ratio} "
                       f"| {r['messages_sent_per_rank_max']:.0f} |")
        stamps = sorted(r["timestamp"] for r in sub)
        out.append(f"\nRun {stamps[0]} .. {stamps[-1]} on `{r0['host']}` ({r0['cpus']} CPUs), "
                   f"{r0['mpi'].split(',')[0]}, Python {r0['python']}; engine: {r0['engine']}.\n")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("jsonl", nargs="+", help="bench_exchange.py --out files")
    p.add_argument("--png", default="docs/results/benchmarks.png")
    p.add_argument("--n", type=int, default=None, help="only records with this n")
    p.add_argument("--density", type=float, default=None, help="only records with this density")
    p.add_argument("--update-md", default=None, help="rewrite the results section of this file")
    p.add_argument("--print-md", action="store_true", help="print the tables to stdout")
    a = p.parse_args(argv)
    recs = load(a.jsonl, a.n, a.density)
    if not recs:
        print("no records", file=sys.stderr)
        return 1
    plot(recs, a.png)
    print(f"wrote {a.png} ({len(recs)} records)", file=sys.stderr)
    text = markdown(recs)
    if a.update_md:
        replace_block(a.update_md, "results", text)
        print(f"updated {a.update_md}", file=sys.stderr)
    if a.print_md:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
