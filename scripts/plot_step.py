#!/usr/bin/env python3
"""Turn the JSON lines of ``python -m horovod_sparse.bench.step`` into the tables of
docs/results/performance.md and a plot.

    python scripts/plot_step.py docs/results/performance.jsonl --md docs/results/performance.md --png docs/results/performance.png
    python scripts/plot_step.py docs/results/data/step-tf.jsonl --framework tensorflow \
        --compare-torch docs/results/data/step-tf-torch.jsonl --md docs/results/performance.md --png docs/results/performance_tf.png

The text between ``<!-- results:begin -->`` and ``<!-- results:end -->`` of the markdown file
is replaced by one table per (model, ranks, link) of PyTorch's records; TensorFlow's tables
go between ``<!-- results-tf:begin -->`` and ``<!-- results-tf:end -->`` (appended under their
own heading if the page has no such block), so regenerating one framework's tables never
touches the other's; the rest (the hand-written prose) is kept. A record without a
``framework`` field is PyTorch's. When several records share (framework, model, np, link,
compressor) the last one read wins. The PNG has one panel per model: each compressor's
median step time per link (log scale), with dense's as a dashed line of the same colour, so
a bar shorter than its line beats dense.

TensorFlow's tables can set each compressor beside PyTorch's for the same model, ranks and
link (``--compare-torch``: PyTorch records measured back to back with the TensorFlow ones,
best round): *torch vs dense*, the PyTorch path's speed-up over its own Horovod dense, and
*TF / torch*, TensorFlow's speed-up over its own dense divided by PyTorch's (1: the
compressor pays off alike through both frameworks; below 1: less through TensorFlow).
"""
from __future__ import annotations

import argparse
import json
import os
import re
from collections import OrderedDict

from doc_block import markers, replace_block

BEGIN, END = markers("results")
#: The generated block of each framework's tables, and the heading a page without it gets.
BLOCKS = {"torch": ("results", "# Step time"),
          "tensorflow": ("results-tf", "## TensorFlow: step time through DistributedGradientTape")}
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


def framework_of(r) -> str:
    """A record's framework: its ``framework`` field; PyTorch for the records before it existed."""
    return r.get("framework", "torch")


def load(paths, framework=None):
    """Records of every file, the last one per (framework, model, np, link, compressor), in
    first-seen order; only ``framework``'s where given."""
    recs = OrderedDict()
    for path in paths:
        with open(path) as f:
            for line in f:
                if line.strip():
                    r = json.loads(line)
                    if r.get("bench") == "step" and framework in (None, framework_of(r)):
                        recs[(framework_of(r), r["model"], r["np"], r["link"], r.get("tf_api", "tape"),
                              r["compressor"])] = r
    return list(recs.values())


def compressor_key(spec: str):
    """The benchmark's default order (dense, Horovod's fp16, sparsifiers, quantizers, ...),
    whatever order the records were read in; unknown names after, by name."""
    name = spec.split(":")[0]
    return (ORDER.index(name), spec) if name in ORDER else (len(ORDER), spec)


def _group_key(r):
    """(model, np, link, TensorFlow API: "tape" or "keras"; "tape" for PyTorch's records)."""
    return r["model"], r["np"], r["link"], r.get("tf_api", "tape")


def groups(recs):
    """OrderedDict (model, np, link, tf_api) -> records, models in first-seen order, links by
    link_key, the tape before Keras, compressors by compressor_key."""
    models = list(OrderedDict.fromkeys(r["model"] for r in recs))
    keys = sorted({_group_key(r) for r in recs},
                  key=lambda k: (models.index(k[0]), k[1], link_key(k[2]), k[3] != "tape"))
    return OrderedDict((k, sorted((r for r in recs if _group_key(r) == k),
                                  key=lambda r: compressor_key(r["compressor"]))) for k in keys)


def _ms(v):
    return "" if v is None else (f"{v:.1f}" if v < 10 else f"{v:.0f}")


def _ratio(v):
    return "" if v is None else f"{v:.2f}x"


def _error(r):
    return r["error"].replace("|", "/")


def _identical(r):
    """The *identical* cell: yes / **NO** / empty, and the error of a run that still has steps."""
    ident = {True: "yes", False: "**NO**", None: ""}[r.get("replicas_identical")]
    return ident + (f" (error: {_error(r)})" if r.get("error") else "")


def _intro(rs, software, extra_bound=""):
    """The heading, the run's description and its bounds: the lines above one group's table.
    ``software`` names the framework's version; ``extra_bound`` ends the bounds' sentence."""
    r0 = rs[0]
    link = "loopback (TCP over lo)" if r0["link"] == "loopback" else f"{r0['link']} per rank link (netem tbf)"
    steps = sorted({r["steps_per_round"] * r["rounds"] for r in rs})
    api = ", Keras `model.train_on_batch`" if r0.get("tf_api") == "keras" else ""
    out = [f"### {r0['model']}, P = {r0['np']}, {link}{api}", "",
           f"{r0['model_desc']}: {r0['params'] / 1e6:.2f}M parameters in {r0['tensors']} tensors, "
           f"batch {r0['batch']}. Median of {'/'.join(map(str, steps))} timed steps "
           f"({r0['rounds']} round(s) x {r0['steps_per_round']}, after {r0['warmup']} warm-up each), "
           f"each the max over ranks; {r0['timestamp'][:10]}, {software}, "
           f"{r0['threads']} thread(s) per rank, {r0['cpus']} cores."
           + (f" **{r0['note']}**" if r0.get("note") else ""), ""]
    bound = (f"Bounds measured in the same run: one copy of the {r0['params'] * 4 / 1e6:.1f} MB float32 "
             f"gradient takes {_ms(r0['copy_ms'])} ms; dense sends {r0['dense_bytes'] / 1e6:.1f} MB per "
             "rank per step (ring allreduce, 2n(P-1)/P floats)")
    if r0.get("link_ms") is not None:
        bound += f", {_ms(r0['link_ms'])} ms at {r0['link']}"
    return out + [bound + extra_bound + ".", ""]


def table(rs) -> str:
    """One markdown table (with its heading and bounds) for the PyTorch records of one group."""
    out = _intro(rs, f"torch {rs[0]['torch']}")
    out += ["| compressor | fwd+bwd ms | opt.step ms | step ms | vs dense | identical |",
            "|---|---:|---:|---:|---:|---|"]
    for r in rs:
        name = LABELS.get(r["compressor"], r["compressor"])
        if r.get("error") and r.get("total_ms") is None:
            out.append(f"| {name} | | | | | error: {_error(r)} |")
            continue
        out.append(f"| {name} | {_ms(r['fwd_bwd_ms'])} | {_ms(r['step_ms'])} | {_ms(r['total_ms'])} "
                   f"| {_ratio(r.get('vs_dense'))} | {_identical(r)} |")
    return "\n".join(out) + "\n"


def _groups_text(rs):
    """How the TensorFlow records grouped their allreduces (``--tf-groups``)."""
    groups = sorted({r.get("tf_groups") or 0 for r in rs})
    return " / ".join("one allreduce request per gradient (Horovod's default)" if g == 0
                      else f"`groups={g}`" for g in groups)


def torch_speedups(rs, torch_recs):
    """Per TensorFlow record of ``rs``: (PyTorch's vs dense for the same model, np, link and
    compressor, TF's vs dense / PyTorch's); (None, None) where either is missing."""
    by_key = {(r["model"], r["np"], r["link"], r["compressor"]): r for r in torch_recs}
    out = []
    for r in rs:
        peer = by_key.get((r["model"], r["np"], r["link"], r["compressor"]), {})
        torch_vs, tf_vs = peer.get("vs_dense"), r.get("vs_dense")
        out.append((torch_vs, tf_vs / torch_vs if tf_vs and torch_vs else None))
    return out


def table_tf(rs, torch_recs=None) -> str:
    """One markdown table for the TensorFlow records of one group; with ``torch_recs`` (PyTorch
    records, any groups) the columns *torch vs dense* and *TF / torch* (see the module's doc)."""
    r0 = rs[0]
    compute = r0.get("compute_ms")
    out = _intro(rs, f"TensorFlow {r0['tensorflow']}, {_groups_text(rs)}",
                 "" if compute is None else
                 f"; the same step without Horovod (plain `tf.GradientTape`) takes {_ms(compute)} ms")
    compare = torch_recs is not None
    out += ["| compressor | step ms | vs dense | identical |" + (" torch vs dense | TF / torch |" if compare else ""),
            "|---|---:|---:|---|" + ("---:|---:|" if compare else "")]
    peers = torch_speedups(rs, torch_recs) if compare else [()] * len(rs)
    for r, peer in zip(rs, peers):
        name = LABELS.get(r["compressor"], r["compressor"])
        cells = [_ratio(v) if i == 0 else ("" if v is None else f"{v:.2f}") for i, v in enumerate(peer)]
        if r.get("error") and r.get("total_ms") is None:
            row = [name, "", "", f"error: {_error(r)}"]
        else:
            row = [name, _ms(r["total_ms"]), _ratio(r.get("vs_dense")), _identical(r)]
        out.append("|" + "".join(f" {c} |" if c else " |" for c in row + cells))
    return "\n".join(out) + "\n"


def _commands(recs):
    """The command lines that produced ``recs`` (the driver's where there was one), in order."""
    cmds = list(OrderedDict.fromkeys(r.get("driver_command") or r["command"] for r in recs))
    return ["```bash"] + cmds + ["```", ""]


def markdown(recs, png=None) -> str:
    parts = ["Produced by:", ""] + _commands(recs)
    if png:
        parts += [f"![step time per compressor]({png})", ""]
    parts += [table(rs) for rs in groups(recs).values()]
    return "\n".join(parts)


def markdown_tf(recs, png=None, torch_recs=None, torch_path=None) -> str:
    """TensorFlow's generated section: the commands, the plot, one :func:`table_tf` per group;
    with ``torch_recs`` (read from ``torch_path``) the PyTorch columns and where they come from."""
    parts = ["Produced by:", ""] + _commands(recs)
    if torch_recs is not None:
        parts += [f"*torch vs dense*: the PyTorch records of `{torch_path}` for the same model, P and "
                  "link (`hvd.DistributedOptimizer`, its own dense); *TF / torch*: TensorFlow's *vs dense* "
                  "over PyTorch's (below 1: the compressor gains less through TensorFlow). Produced by:", ""]
        parts += _commands(torch_recs) if torch_recs else ["(no PyTorch records there)", ""]
    if png:
        parts += [f"![TensorFlow step time per compressor]({png})", ""]
    parts += [table_tf(rs, torch_recs) for rs in groups(recs).values()]
    return "\n".join(parts)


def section(recs, png, framework="torch", compare_torch=None):
    """The generated section of ``framework``'s records (:func:`markdown` or
    :func:`markdown_tf`, the latter with the PyTorch records of the file ``compare_torch``)."""
    if framework == "torch":
        return markdown(recs, png)
    torch_recs = load([compare_torch], "torch") if compare_torch else None
    return markdown_tf(recs, png, torch_recs, compare_torch)


def update_md(path, text, framework="torch"):
    """Replace ``framework``'s block of ``path`` (:data:`BLOCKS`) by ``text``; a page without
    one (or no page yet) gets the block appended under its heading."""
    name, heading = BLOCKS[framework]
    replace_block(path, name, text, heading=heading)


def plot(recs, png, framework="torch"):
    """One panel per (model, P): bars per compressor and link, dense's step dashed; the
    records' ``framework`` names the step in the axis label and the panels' titles."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    by_model = OrderedDict()
    for (model, np_, link, api), rs in groups(recs).items():
        if api == "tape":  # the plot shows the main API; Keras' rows are in the tables
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
        ax.set_xlabel("median step (fwd+bwd+opt.step), ms; dashed: dense" if framework == "torch" else
                      "median step (one tf.function call), ms; dashed: dense")
        r0 = links[0][1][0]
        ax.set_title(f"{model} ({r0['params'] / 1e6:.1f}M params), P={np_}"
                     + ("" if framework == "torch" else f", {framework}"))
        ax.grid(axis="x", which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", nargs="+", help="JSON lines from horovod_sparse.bench.step")
    p.add_argument("--framework", choices=sorted(BLOCKS), default="torch",
                   help="whose records to show, in which block of --md (default torch)")
    p.add_argument("--compare-torch", default=None, metavar="FILE",
                   help="tensorflow only: PyTorch records to compare each compressor's speed-up with")
    p.add_argument("--md", default=None, help="markdown file whose results section is regenerated")
    p.add_argument("--png", default=None, help="write the plot here")
    a = p.parse_args(argv)
    if a.compare_torch and a.framework != "tensorflow":
        p.error("--compare-torch is for --framework tensorflow")
    recs = load(a.data, a.framework)
    if not recs:
        p.error(f"no {a.framework} step records in " + " ".join(a.data))
    if a.png:
        plot(recs, a.png, a.framework)
    png = os.path.relpath(a.png, os.path.dirname(os.path.abspath(a.md))) if a.md and a.png else None
    text = section(recs, png, a.framework, a.compare_torch)
    if a.md:
        update_md(a.md, text, a.framework)
    if not (a.md or a.png):
        print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
