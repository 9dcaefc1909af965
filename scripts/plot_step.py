#!/usr/bin/env python3
"""Turn the JSON lines of ``python -m horovod_sparse.bench.step`` into the tables of
docs/performance.md and a plot.

    python scripts/plot_step.py docs/performance.jsonl --md docs/performance.md --png docs/performance.png

The text between ``<!-- results:begin -->`` and ``<!-- results:end -->`` of the markdown file
is replaced by one table per (model, ranks, link); the rest (the hand-written intro) is kept.
When several records share (model, np, link, compressor) the last one read wins. The PNG has
one panel per model: each compressor's median step time per link (log scale), with dense's as a
dashed line of the same colour, so a bar shorter than its line beats dense.
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import OrderedDict

from doc_block import markers, replace_block

BEGIN, END = markers("results")
ORDER = ["dense", "hvd-none", "hvd-fp16", "none", "fp16", "topk", "oktopk", "gtopk", "gaussiank", "dgc",
         "randomk", "threshold", "bf16", "qsgd", "terngrad", "signsgd", "signum", "efsignsgd", "onebit",
         "powersgd", "fft"]
LABELS = {"dense": "dense (Horovod none)", "hvd-none": "dense (Horovod none)", "hvd-fp16": "fp16 (Horovod)"}
_UNIT = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def link_key(link: str):
    """Loopback first, then the fastest link to the slowest (more and more network-bound)."""
    m = re.match(r"^(\d+(?:\.\d+)?)([kmgt]?)i?(bit|bps)$", link.lower())
    if not m:
        return (0, 0.0, link)
    return (1, -float(m.group(1)) * _UNIT[m.group(2)] * (8 if m.group(3) == "bps" else 1), link)


def load(paths):
    """Records of every file, the last one per (model, np, link, compressor), in first-seen order."""
    recs = OrderedDict()
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("bench") == "step":
                        recs[(r["model"], r["np"], r["link"], r["compressor"])] = r
    return list(recs.values())


def compressor_key(spec: str):
    """The benchmark's default order (dense, Horovod's fp16, sparsifiers, quantizers, ...),
    whatever order the records were read in; unknown names after, by name."""
    name = spec.split(":")[0]
    return (ORDER.index(name), spec) if name in ORDER else (len(ORDER), spec)


def groups(recs):
    """OrderedDict (model, np, link) -> records, models in first-seen order, links by link_key,
    compressors by compressor_key."""
    models = list(OrderedDict.fromkeys(r["model"] for r in recs))
    keys = sorted({(r["model"], r["np"], r["link"]) for r in recs},
                  key=lambda k: (models.index(k[0]), k[1], link_key(k[2])))
    return OrderedDict((k, sorted((r for r in recs if (r["model"], r["np"], r["link"]) == k),
                                  key=lambda r: compressor_key(r["compressor"]))) for k in keys)


def _ms(v):
    return "" if v is None else (f"{v:.1f}" if v < 10 else f"{v:.0f}")


def table(rs) -> str:
    """One markdown table (with its heading and bounds) for the records of one group."""
    r0 = rs[0]
    link = "loopback (TCP over lo)" if r0["link"] == "loopback" else f"{r0['link']} per rank link (netem tbf)"
    steps = sorted({r["steps_per_round"] * r["rounds"] for r in rs})
    out = [f"### {r0['model']}, P = {r0['np']}, {link}", "",
           f"{r0['model_desc']}: {r0['params'] / 1e6:.2f}M parameters in {r0['tensors']} tensors, "
           f"batch {r0['batch']}. Median of {'/'.join(map(str, steps))} timed steps "
           f"({r0['rounds']} round(s) x {r0['steps_per_round']}, after {r0['warmup']} warm-up each), "
           f"each the max over ranks; {r0['timestamp'][:10]}, torch {r0['torch']}, "
           f"{r0['threads']} thread(s) per rank, {r0['cpus']} cores."
           + (f" **{r0['note']}**" if r0.get("note") else ""), ""]
    bound = (f"Bounds measured in the same run: one copy of the {r0['params'] * 4 / 1e6:.1f} MB float32 "
             f"gradient takes {_ms(r0['copy_ms'])} ms; dense sends {r0['dense_bytes'] / 1e6:.1f} MB per "
             "rank per step (ring allreduce, 2n(P-1)/P floats)")
    if r0.get("link_ms") is not None:
        bound += f", {_ms(r0['link_ms'])} ms at {r0['link']}"
    out += [bound + ".", "",
            "| compressor | fwd+bwd ms | opt.step ms | step ms | vs dense | identical |",
            "|---|---:|---:|---:|---:|---|"]
    for r in rs:
        name = LABELS.get(r["compressor"], r["compressor"])
        if r.get("error") and r.get("total_ms") is None:
            out.append(f"| {name} | | | | | error: {r['error'].replace('|', '/')} |")
            continue
        ident = {True: "yes", False: "**NO**", None: ""}[r.get("replicas_identical")]
        if r.get("error"):
            ident += f" (error: {r['error'].replace('|', '/')})"
        vs = "" if r.get("vs_dense") is None else f"{r['vs_dense']:.2f}x"
        out.append(f"| {name} | {_ms(r['fwd_bwd_ms'])} | {_ms(r['step_ms'])} | {_ms(r['total_ms'])} "
                   f"| {vs} | {ident} |")
    return "\n".join(out) + "\n"


def markdown(recs, png=None) -> str:
    cmds = list(OrderedDict.fromkeys(r.get("driver_command") or r["command"] for r in recs))
    parts = ["Produced by:", "", "```bash"] + cmds + ["```", ""]
    if png:
        parts += [f"![step time per compressor]({png})", ""]
    parts += [table(rs) for rs in groups(recs).values()]
    return "\n".join(parts)


def update_md(path, text):
    """Replace the results block of ``path`` by ``text``; a page without one (or no page yet)
    gets a ``# Step time`` heading and the block appended."""
    replace_block(path, "results", text, heading="# Step time")


def plot(recs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    by_model = OrderedDict()
    for (model, np_, link), rs in groups(recs).items():
        by_model.setdefault((model, np_), []).append((link, rs))
    specs = {m: sorted({r["compressor"] for _, rs in g for r in rs}, key=compressor_key)
             for m, g in by_model.items()}
    height = max(len(s) for s in specs.values()) * 0.32 + 1.5
    fig, axes = plt.subplots(1, len(by_model), figsize=(6.2 * len(by_model), height), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, ((model, np_), links) in zip(axes[0], by_model.items()):
        names = specs[(model, np_)]
        width = 0.8 / len(links)
        for j, (link, rs) in enumerate(links):
            by_spec = {r["compressor"]: r for r in rs}
            ys, xs = [], []
            for i, spec in enumerate(names):
                r = by_spec.get(spec)
                if r and r.get("total_ms"):
                    ys.append(i - 0.4 + width * (j + 0.5))
                    xs.append(r["total_ms"])
            c = colors[j % len(colors)]
            ax.barh(ys, xs, height=width, color=c, label=link)
            dense = by_spec.get("dense")
            if dense and dense.get("total_ms"):
                ax.axvline(dense["total_ms"], color=c, linestyle="--", linewidth=1)
        ax.set_yticks(range(len(names)), [LABELS.get(n, n) for n in names], fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")   # qsgd/fft are 10x dense: a linear axis hides everything else
        lows = [r["total_ms"] for _, rs in links for r in rs if r.get("total_ms")]
        if lows:
            ax.set_xlim(left=min(lows) / 2)   # every bar visibly long, the shortest too
        ax.xaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("median step (fwd+bwd+opt.step), ms; dashed: dense")
        r0 = links[0][1][0]
        ax.set_title(f"{model} ({r0['params'] / 1e6:.1f}M params), P={np_}")
        ax.grid(axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", help="JSON lines from horovod_sparse.bench.step")
    p.add_argument("--md", default=None, help="markdown file whose results section is regenerated")
    p.add_argument("--png", default=None, help="write the plot here")
    a = p.parse_args(argv)
    recs = load(a.data)
    if not recs:
        p.error("no step records in " + " ".join(a.data))
    if a.png:
        plot(recs, a.png)
    if a.md:
        png = os.path.relpath(a.png, os.path.dirname(os.path.abspath(a.md))) if a.png else None
        update_md(a.md, markdown(recs, png))
    if not (a.md or a.png):
        print(markdown(recs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
