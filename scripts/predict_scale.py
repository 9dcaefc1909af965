#!/usr/bin/env python3
"""Fit the exchange cost model to timed exchanges, check it, and predict to P = 1024 (no MPI).

    python scripts/predict_scale.py \
        --records docs/results/data/oktopk-scale/timed-1gbit.jsonl docs/results/data/oktopk-scale/timed-10gbit.jsonl \
        --selections docs/results/data/oktopk-scale/selections.npz \
        --plot docs/results/oktopk-scale-predicted.png --page docs/results/oktopk-scale.md

Per link (the records' ``rate``): :func:`horovod_sparse.whatif.exchange_cost.fit` of the
per-call, per-message and per-byte-received costs from every record of that link (the bytes
sent charged at the link's nominal rate, ``--fit-bandwidth`` to fit it too), the predicted
against the measured time of each (algorithm, P), then, with the 10 Gbit/s fit's per-call,
per-message and local costs on nominal 10, 25 and 100 Gbit/s links, one exchange at
P = 16-1024 for a BERT-base-sized gradient and the two workloads' sizes (density 0.01), the P
from which Ok-Topk is faster than each other algorithm, and one training step of the shipped
NetAI'20 traces (the fused exchange after backward). The overlap of the selections (TopkDSA's
union; Ok-Topk's only through the exact threshold's gather) is the measured trend of
``--selections`` (``--overlap uniform``: independent selections, the largest union).
The markdown goes to stdout and, with ``--page``, into the page's
``<!-- oktopk-predict:begin/end -->`` block.
"""
import argparse
import datetime as _dt
import json
import os
import sys

import numpy as np

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

from horovod_sparse.whatif import exchange_cost as ec  # noqa: E402
from horovod_sparse.whatif import volumes as vol  # noqa: E402

ORDER, LABELS = vol.ALGORITHMS, vol.LABELS
#: gradient sizes (elements) predicted: BERT-base, and the two real workloads' models
MODELS = {"BERT-base (110M)": 110_000_000, "transformer LM (19.2M)": 19_200_000,
          "ResNet-18 (11.2M)": 11_200_000}
LINKS = (10, 25, 100)
PS = [2 ** i for i in range(1, 11)]
TRACES = ("resnet50", "vgg16")


def load_records(paths):
    """(exchange records, ping-pong records) of the files; a case timed in several rounds is one
    record, its rounds' calls pooled (:func:`~horovod_sparse.whatif.exchange_cost.pool_rounds`)."""
    out = []
    for path in paths:
        with open(path) as f:
            out += [json.loads(line) for line in f if line.strip()]
    return ec.pool_rounds([r for r in out if r.get("per_call")]), [r for r in out if r.get("kind") == "pingpong"]


def measured_alpha(pingpongs):
    """MPI's one-way time of a small message: the median over the ping-pong records (None without)."""
    return float(np.median([r["median_s"] for r in pingpongs])) if pingpongs else None


def by_link(records):
    links = {}
    for r in records:
        links.setdefault(r["rate"], []).append(r)
    return dict(sorted(links.items(), key=lambda kv: _gbps(kv[0])))


def _gbps(rate):
    t = rate.lower().replace("bit", "")
    mult = {"g": 1.0, "m": 1e-3, "k": 1e-6}.get(t[-1:], None)
    return float(t[:-1]) * mult if mult else float(t) / 1e9


def model_unions(specs):
    """``--unions NAME=FILE``: {model name of MODELS (matched by its start): (Overlap, unions, file)},
    from the recorded unions of ``record_selections.py --out FILE.json`` (its first recorded step)."""
    out = {}
    for spec in specs or ():
        prefix, _, path = spec.partition("=")
        names = [m for m in MODELS if m.startswith(prefix)]
        if len(names) != 1 or not path:
            raise SystemExit(f"--unions {spec!r}: want NAME=FILE, NAME the start of one of {list(MODELS)}")
        with open(path) as f:
            data = json.load(f)
        step = sorted(data["unions"], key=int)[0]
        unions = {int(P): u for P, u in data["unions"][step].items()}
        out[names[0]] = (ec.Overlap.fitted(unions, data["k"]), unions, path, data["workload"], int(step))
    return out


def _trend_text(trend, unions):
    """An overlap trend in words, with the unions it was fitted to."""
    return (f"union = {trend.coefficient:.3f} k P^{trend.exponent:.3f} (from P = {', '.join(map(str, unions))}: "
            f"{', '.join(f'{u:,}' for u in unions.values())})")


def overlap_trend(selections, step):
    with np.load(selections) as f:
        row = f["steps"].tolist().index(step)
        idx, k = f["indices"][row], int(f["k"])
    unions = ec.selection_unions(idx)
    return ec.Overlap.fitted(unions, k), unions


def fit_section(links, step=None, fit_bandwidth=False, alpha=None, uniform=True):
    """Joint fit over the links (the per-call and per-message costs and every gamma_a shared;
    each link's bytes at its nominal rate, or a bandwidth fitted per link), with the emulated
    links' token-bucket burst; and, for comparison, each link alone."""
    steps = (step, None) if uniform else (step,)
    mine = {rate: [r for r in recs if step is None or r.get("selections_step") in steps]
            for rate, recs in links.items()}
    nominal = None if fit_bandwidth else {rate: _gbps(rate) * 1e9 for rate in mine}
    joint = ec.fit_links(mine, burst_bytes=ec.NETEM_BURST_BYTES, bandwidth_bps=nominal, latency_s=alpha)
    own = {rate: ec.fit(recs, burst_bytes=ec.NETEM_BURST_BYTES, bandwidth_bps=nominal and nominal[rate],
                        latency_s=alpha)
           for rate, recs in mine.items()}
    sparse = [a for a in ORDER if a != "dense"]
    head = ("| fit | link | records | "
            + " | ".join(f"per call {LABELS[a]} (us)" for a in ORDER)
            + " | alpha: per message (us) | wait per message per other rank on a core (us) | "
            "beta: per byte sent (ns) = Gbit/s | "
            + " | ".join(f"gamma {LABELS[a]} (ns/B received)" for a in ORDER) + " | "
            + " | ".join(f"kappa {LABELS[a]} (ns/entry)" for a in sparse) + " |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for label, fits in (("joint", joint), ("this link alone", own)):
        for rate, c in fits.items():
            bw = "no cost (burst covers it)" if c.beta_s == 0 else f"{c.beta_s * 1e9:.3f} = {c.network.gbps:.2f}"
            if nominal:
                bw += " (nominal)"
            lines.append(f"| {label} | {rate} | {len(mine[rate])} | "
                         + " | ".join(f"{c.call_s.get(a, 0.0) * 1e6:.0f}" for a in ORDER)
                         + f" | {c.alpha_s * 1e6:.1f}{' (measured)' if alpha is not None else ''} | "
                         f"{c.wakeup_s * 1e6:.1f} | {bw} | "
                         + " | ".join(f"{c.local_s_per_byte.get(a, 0.0) * 1e9:.3f}" for a in ORDER) + " | "
                         + " | ".join(f"{c.local_s_per_selected.get(a, 0.0) * 1e9:.1f}" for a in sparse) + " |")
    return "\n".join(lines) + "\n", joint, own


def _step(record):
    """Sort key: the recorded step, synthetic records (no recorded selections) last."""
    step = record.get("selections_step")
    return 10**9 if step is None else step


def _step_label(record):
    step = record.get("selections_step")
    return f"uniform, n = {record['n'] / 1e6:.1f}M" if step is None else step


def validation_section(links, fits, own, fit_step=None, uniform=True):
    lines = ["| link | step | algorithm | P | ranks per core | messages (critical) | MB sent (critical) | "
             "MB received (busiest) | measured ms (median) | min-max ms | rounds' medians ms | predicted ms (joint fit) | "
             "error | predicted (link alone) | error |",
             "|" + " --- |" * 15]
    errors = []
    for rate, recs in links.items():
        rows = ec.validation(recs, fits[rate])
        alone = {id(r): (p, e) for r, p, _, e in ec.validation(recs, own[rate])}
        rows.sort(key=lambda x: (_step(x[0]), ORDER.index(x[0]["algorithm"]), x[0]["P"]))
        for rec, p, m, e in rows:
            f = ec.features(rec)
            p2, e2 = alone[id(rec)]
            errors.append((rate, _step_label(rec), rec["algorithm"], rec["P"], e))
            lines.append(f"| {rate} | {_step_label(rec)} | {LABELS[rec['algorithm']]} | {rec['P']} | "
                         f"{f.oversubscription:g} | {f.messages:.0f} | {(f.bytes_sent + f.chain_bytes) / 1e6:.3f} | "
                         f"{f.bytes_received / 1e6:.3f} | {m * 1e3:.1f} | "
                         f"{rec['min_s'] * 1e3:.1f}-{rec['max_s'] * 1e3:.1f} | "
                         f"{', '.join(f'{x * 1e3:.1f}' for x in rec.get('round_medians_s', [m]))} | {p * 1e3:.1f} | {e:+.0%} | "
                         f"{p2 * 1e3:.1f} | {e2:+.0%} |")
    lines.append("")
    for step in sorted({x[1] for x in errors}, key=lambda s: (isinstance(s, str), str(s).zfill(6))):
        for rate in links:
            mine = [x for x in errors if x[1] == step and x[0] == rate]
            if not mine:
                continue
            within = sum(1 for *_, e in mine if abs(e) <= 0.2)
            miss = ", ".join(f"{LABELS[a]} P = {P} ({e:+.0%})" for _, _, a, P, e in mine if abs(e) > 0.2)
            what = f"recorded step {step}" if isinstance(step, int) else f"{step.replace('uniform', 'uniform inputs')}"
            fitted = fit_step is None or step == fit_step or (uniform and not isinstance(step, int))
            what += " (in the fit)" if fitted else " (out of sample)"
            lines.append(f"joint fit, {rate}, {what}: {within} of {len(mine)} within 20%, mean "
                         f"|error| {np.mean([abs(e) for *_, e in mine]):.0%}; outside 20%: {miss or 'none'}  ")
    return "\n".join(lines) + "\n", errors


#: other costs per message the crossovers are repeated with: the what-if model's default, and
#: what a message cost where an engine's work per peer is charged to it (the fit of 2026-11-26)
OTHER_ALPHAS = (25e-6, 150e-6)


def prediction_tables(base, overlap, alpha_label="alpha", other_alphas=OTHER_ALPHAS, own=None):
    """``own``: {model name: its own overlap trend}, else ``overlap``."""
    out, sweeps, others = [], {}, {a: {} for a in other_alphas}
    for gbps in LINKS:
        cost = base.on_link(gbps)
        for name, n in MODELS.items():
            k = int(round(0.01 * n))
            trend = (own or {}).get(name, overlap)
            sweeps[(gbps, name)] = ec.sweep(n, k, PS, cost, ORDER, trend)
            for alpha, table in others.items():
                table[(gbps, name)] = ec.sweep(n, k, PS, base.on_link(gbps, alpha), ORDER, trend)
    # seconds per exchange, BERT-base
    name = next(iter(MODELS))
    head = "| link | algorithm | " + " | ".join(f"P = {p}" for p in PS) + " |"
    lines = [f"one exchange, {name}, density 0.01: predicted ms (busiest rank's counts from the closed forms; "
             "Ok-Topk: mean over its 64-call cycle)", "", head, "|" + " --- |" * (len(PS) + 2)]
    for gbps in LINKS:
        t = sweeps[(gbps, name)]
        best = [min(ORDER, key=lambda a: t[a][i]) for i in range(len(PS))]
        for a in ORDER:
            cells = [(f"**{t[a][i] * 1e3:,.0f}**" if best[i] == a else f"{t[a][i] * 1e3:,.0f}")
                     for i in range(len(PS))]
            lines.append(f"| {gbps} Gbit/s | {LABELS[a]} | " + " | ".join(cells) + " |")
    out.append("\n".join(lines) + "\n")
    # crossovers
    tables = [(f"{alpha_label} {base.alpha_s * 1e6:.0f} us", sweeps)]
    tables += [(f"alpha {alpha * 1e6:.0f} us", table) for alpha, table in others.items()]
    for label, table in tables:
        lines, c = crossover_table(table, label)
        out.append(lines)
        if table is sweeps:
            cross = c
    return out, sweeps, cross


def crossover_table(sweeps, label):
    lines = [f"{label}: from which P (of 2-1024) Ok-Topk is predicted faster than each, at every larger P "
             "(\"always\": from 2 on; \"only up to\": faster at small P, slower from the next P on; \"never\": "
             "at no P); fastest at P = 16 and 1024", "",
             "| gradient | link | vs TopkA | vs gTop-k | vs TopkDSA | vs dense | fastest at 16 | fastest at 1024 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    cross = {}
    for name in MODELS:
        for gbps in LINKS:
            t = sweeps[(gbps, name)]
            cells = []
            for other in ("allgather", "gtopk", "dsa", "dense"):
                c = ec.crossover(t, PS, "oktopk", other)
                cross[(name, gbps, other)] = c
                lead = ec.lead_until(t, PS, "oktopk", other)
                if c is not None:
                    cells.append("always" if c == PS[0] else f"from P = {c}")
                elif lead is not None:
                    cells.append(f"only up to P = {lead}")
                else:
                    cells.append("never")
            first = min(ORDER, key=lambda a: t[a][PS.index(16)])
            last = min(ORDER, key=lambda a: t[a][-1])
            lines.append(f"| {name} | {gbps} Gbit/s | " + " | ".join(cells) +
                         f" | {LABELS[first]} | {LABELS[last]} |")
    return "\n".join(lines) + "\n", cross


def step_table(base, overlap):
    from horovod_sparse.whatif import load
    lines = ["one training step = the trace's t_batch + one fused exchange after backward (no overlap, "
             "no selection cost), density 0.01; speed-up of Ok-Topk over each", "",
             "| trace (n) | link | P | t_batch ms | dense | TopkA | gTop-k | TopkDSA | Ok-Topk | "
             "Ok-Topk vs TopkA / gTop-k / dense |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for tname in TRACES:
        tr = load(f"netai:{tname}")
        n = int(tr.nbytes // 4)
        k = int(round(0.01 * n))
        for gbps in LINKS:
            cost = base.on_link(gbps)
            for P in (16, 256, 1024):
                step = {a: tr.batch_time_s + ec.predict_seconds(a, n, k, P, cost, overlap) for a in ORDER}
                sp = " / ".join(f"{step[o] / step['oktopk']:.2f}x" for o in ("allgather", "gtopk", "dense"))
                lines.append(f"| {tname} ({n / 1e6:.1f}M) | {gbps} Gbit/s | {P} | {tr.batch_time_s * 1e3:.0f} | "
                             + " | ".join(f"{step[a] * 1e3:,.0f}" for a in ORDER) + f" | {sp} |")
    return "\n".join(lines) + "\n"


def plot(sweeps, cross, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    name = next(iter(MODELS))
    fig, axes = plt.subplots(1, len(LINKS), figsize=(14, 4.3), sharey=True)
    for ax, gbps in zip(axes, LINKS):
        t = sweeps[(gbps, name)]
        for i, a in enumerate(ORDER):
            ax.plot(PS, [s * 1e3 for s in t[a]], "o-", color=f"C{i}", label=LABELS[a], ms=3)
        for other in ("allgather", "gtopk", "dsa", "dense"):
            c = cross[(name, gbps, other)]
            if c is not None and c != PS[0]:
                y = t["oktopk"][PS.index(c)] * 1e3
                ax.plot([c], [y], marker="*", ms=13, color="k", zorder=5)
                ax.annotate(f"beats {LABELS[other]}", (c, y), textcoords="offset points", xytext=(4, -12),
                            fontsize=7)
            lead = ec.lead_until(t, PS, "oktopk", other)
            if c is None and lead is not None and lead != PS[-1]:
                after = PS[PS.index(lead) + 1]
                y = t[other][PS.index(after)] * 1e3
                ax.plot([after], [y], marker="X", ms=11, color="k", zorder=5)
                ax.annotate(f"{LABELS[other]} faster\nfrom P = {after}", (after, y), textcoords="offset points",
                            xytext=(-70, 8), fontsize=7)
        ax.set(xscale="log", yscale="log", title=f"{gbps} Gbit/s", xlabel="P (ranks)")
        ax.set_xticks(PS)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("predicted ms per exchange")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{name}, density 0.01: one exchange, predicted (costs per call, per message, per byte received "
                 "and per entry selected; nominal link rate)\n* = from here on Ok-Topk is faster; X = from here on "
                 "the other is faster than Ok-Topk", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", nargs="+", required=True, help="timed bench records (jsonl)")
    p.add_argument("--selections", help="recorded selections: the overlap trend")
    p.add_argument("--step", type=int, default=30, help="recorded step for the overlap trend")
    p.add_argument("--fit-step", type=int, default=30,
                   help="fit on the records of this recorded step (and on those of uniform random inputs, "
                        "which have none); the other steps' records are the out-of-sample check")
    p.add_argument("--overlap", choices=("trend", "uniform"), default="trend")
    p.add_argument("--recorded-only", action="store_true",
                   help="fit on the recorded step alone: the uniform inputs (another selection size) out of sample")
    p.add_argument("--fit-alpha", action="store_true",
                   help="fit the per-message cost too (default: the ping-pong records' measured one, where given)")
    p.add_argument("--fit-bandwidth", action="store_true",
                   help="fit each link's bandwidth too (default: its nominal rate, from the records' rate)")
    p.add_argument("--unions", nargs="*", metavar="NAME=FILE",
                   help="a model's own overlap trend (NAME: the start of a predicted model's name, FILE: "
                        "record_selections.py --out FILE.json); the others take --selections'")
    p.add_argument("--base", default="10gbit", help="the link whose fitted alpha and gamma go to the predictions")
    p.add_argument("--plot")
    p.add_argument("--page")
    a = p.parse_args(argv)
    records, pingpongs = load_records(a.records)
    links = by_link(records)
    alpha = None if a.fit_alpha else measured_alpha(pingpongs)
    fit_md, fits, alone = fit_section(links, a.fit_step, a.fit_bandwidth, alpha, not a.recorded_only)
    val_md, _ = validation_section(links, fits, alone, a.fit_step, not a.recorded_only)
    overlap, unions = None, {}
    if a.overlap == "trend":
        if not a.selections:
            p.error("--overlap trend needs --selections")
        overlap, unions = overlap_trend(a.selections, a.step)
    base = fits[a.base]
    own_trends = model_unions(a.unions)
    preds, sweeps, cross = prediction_tables(base, overlap, "fitted alpha" if alpha is None else "measured alpha",
                                             own={name: o[0] for name, o in own_trends.items()})
    steps = step_table(base, overlap)
    today = _dt.date.today().isoformat()
    ov = ("uniform bound (independent selections)" if overlap is None else
          f"measured trend at recorded step {a.step}: {_trend_text(overlap, unions)}, capped by the uniform union")
    for name, (trend, own_unions, path, workload, step) in own_trends.items():
        ov += (f"; for {name}, its own: {workload}'s selections at step {step} "
               f"({os.path.relpath(path, _REPO)}): {_trend_text(trend, own_unions)}")
    text = (f"generated {today} by `scripts/predict_scale.py` from "
            f"{', '.join(os.path.relpath(x, _REPO) for x in a.records)}\n\n"
            f"**Fit** (joint over the links, and each link alone; non-negative least squares on relative error; "
            f"all algorithms and P of recorded step {a.fit_step}"
            + ("" if a.recorded_only else " and of the uniform random inputs") + "; token-bucket "
            f"burst {ec.NETEM_BURST_BYTES // 1024} KiB per sender; "
            + ("each link's bandwidth fitted" if a.fit_bandwidth else "bytes sent at each link's nominal rate")
            + ("; alpha fitted" if alpha is None else
               f"; alpha = MPI's one-way time of a small message, measured by ping-pong ({alpha * 1e6:.1f} us)")
            + "; ranks per core from the records' cpus):\n\n"
            + fit_md + "\n**Predicted against measured** (the joint fit, and the fit of that link alone; records of other "
            "inputs than the fit's are out of sample):\n\n" + val_md
            + "\n**Predictions** with the joint fit's costs per call ("
            + ", ".join(f"{LABELS[x]} {base.call_s.get(x, 0) * 1e6:.0f} us" for x in ORDER) + "), alpha = "
            f"{base.alpha_s * 1e6:.1f} us per message and "
            f"local work per byte received ({', '.join(f'{LABELS[x]} {base.local_s_per_byte.get(x, 0) * 1e9:.2f} ns' for x in ORDER)}) "
            f"and per entry selected ({', '.join(f'{LABELS[x]} {base.local_s_per_selected.get(x, 0) * 1e9:.0f} ns' for x in ORDER if x != 'dense')}), "
            f"one rank per core (so no wait per message for a shared core), on real links at the nominal rate "
            f"(no burst); overlap: {ov}.\n\n"
            + "\n".join(preds) + "\n" + steps)
    print(text)
    print(f"[fit] FITTED = {{'call_s': {base.call_s!r}, 'alpha_s': {base.alpha_s!r}, 'wakeup_s': {base.wakeup_s!r}, "
          f"'local_s_per_byte': {base.local_s_per_byte!r}, 'local_s_per_selected': {base.local_s_per_selected!r}}}",
          file=sys.stderr)
    if a.page:
        sys.path.insert(0, os.path.join(_REPO, "scripts"))
        from doc_block import replace_block
        replace_block(a.page, "oktopk-predict", text)
    if a.plot:
        plot(sweeps, cross, a.plot)
        print(f"[plot] {a.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
