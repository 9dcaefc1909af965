#!/usr/bin/env python3
"""The end-to-end step benchmark of docs/results/performance.md: every compressor side by side with
dense, through the stock ``hvd.DistributedOptimizer`` (or, ``--framework tensorflow``,
``hvd.DistributedGradientTape``), on each link.

    python scripts/bench_step.py                                   # the full run (needs root for netem)
    python scripts/bench_step.py --links loopback 1gbit --models mlp5 --steps 2 --warmup 1 \\
        --compressors dense hvd-fp16 topk:density=0.01 qsgd        # a quick harness check
    python scripts/bench_step.py --report                          # only regenerate the doc
    python scripts/bench_step.py --framework tensorflow --compare-torch docs/results/data/step-tf-torch.jsonl

For each link: ``scripts/netem.py --rate R -np N -- python -m horovod_sparse.bench.step ...``
(``loopback`` is ``--rate none``: mpirun over TCP on lo, no namespaces), with one thread per
rank and ranks that yield while waiting in MPI (2 ranks may share 2 cores with nothing
else). The ranks append records to ``--out`` (emptied first). When the links are done the
records are copied to ``--data`` and ``--md``'s results section and ``--png`` are
regenerated from it (scripts/plot_step.py). A link whose run fails or exceeds ``--timeout``
is reported and skipped; the others still run.

Each framework keeps its own files and its own generated block of ``--md`` (PyTorch:
``results``, docs/results/performance.jsonl, docs/results/performance.png; TensorFlow: ``results-tf``,
docs/results/data/step-tf.jsonl, docs/results/performance_tf.png, results/step-tf.jsonl for ``--out``), so a
run of one never touches the other's. TensorFlow's tables can compare each compressor's
speed-up with PyTorch's from the records of ``--compare-torch`` (scripts/plot_step.py).
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]

from horovod_sparse.bench import step  # noqa: E402  (stdlib only at import)
import plot_step  # noqa: E402

#: What every rank's environment gets: one BLAS/OpenMP thread (2 ranks, 2 cores), Keras 2 for
#: Horovod's TensorFlow side should it be imported, mpirun as root without its prompt.
RANK_ENV = {"OMP_NUM_THREADS": "1", "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN_ARGS = "--bind-to none --mca mpi_yield_when_idle 1"
#: Per framework, where its records, data and plot go unless --out, --data, --png say otherwise.
FILES = {"torch": {"out": "results/step.jsonl", "data": "docs/results/performance.jsonl", "png": "docs/results/performance.png"},
         "tensorflow": {"out": "results/step-tf.jsonl", "data": "docs/results/data/step-tf.jsonl",
                        "png": "docs/results/performance_tf.png"}}


def default_python():
    venv = os.path.join(REPO, ".venv", "bin", "python")
    return venv if os.access(venv, os.X_OK) else sys.executable


def build_parser():
    p = argparse.ArgumentParser(prog="bench_step.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--framework", choices=step.FRAMEWORKS, default="torch",
                   help="torch: hvd.DistributedOptimizer; tensorflow: hvd.DistributedGradientTape "
                        "(its own --out, --data, --png and block of --md) (default torch)")
    p.add_argument("--tf-api", choices=("tape", "keras"), default="tape",
                   help="with --framework tensorflow: hvd.DistributedGradientTape (tape) or Keras "
                        "model.train_on_batch through Horovod's Keras DistributedOptimizer (default tape)")
    p.add_argument("--tf-groups", type=int, default=0, metavar="N",
                   help="tensorflow: DistributedGradientTape(groups=N) for every compressor; 0: "
                        "Horovod's default, one request per gradient (default 0)")
    p.add_argument("--compare-torch", default=None, metavar="FILE",
                   help="tensorflow: PyTorch records (bench_step.py --data) whose speed-ups the TF "
                        "tables set beside TF's: columns 'torch vs dense' and 'TF / torch'")
    p.add_argument("--np", type=int, default=2, help="MPI ranks (default 2)")
    p.add_argument("--links", nargs="+", default=["loopback", "1gbit", "10gbit"],
                   help="tc rates per rank link, or loopback (default: loopback 1gbit 10gbit)")
    p.add_argument("--models", nargs="+", default=["mlp5", "mlp30"], choices=step.MODEL_CHOICES,
                   help="default: mlp5 mlp30")
    p.add_argument("--recipe", default=None, type=step.recipe_spec,
                   help="torch: the optimizer of a training recipe instead of plain SGD (default none)")
    p.add_argument("--model", type=step.parse_size, default={}, metavar="KEY=INT,...",
                   help="the language model's size (--models stdlib_lm), as bench_tta's --model")
    p.add_argument("--compressors", nargs="+", default=list(step.DEFAULT_COMPRESSORS), metavar="SPEC",
                   help="dense, hvd-fp16, or horovod_sparse specs (default: all %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per round (default 3)")
    p.add_argument("--rounds", type=int, default=1, help="interleaved repeats of the list (default 1)")
    p.add_argument("--out", default=None, help="records of this run (emptied first; default "
                   f"{FILES['torch']['out']}, {FILES['tensorflow']['out']} for tensorflow)")
    p.add_argument("--data", default=None,
                   help="where the records are kept for the doc (copied from --out after the run; "
                        f"default {FILES['torch']['data']}, {FILES['tensorflow']['data']} for tensorflow)")
    p.add_argument("--md", default="docs/results/performance.md", help="doc whose results section is regenerated")
    p.add_argument("--png", default=None, help=f"plot (default {FILES['torch']['png']}, "
                   f"{FILES['tensorflow']['png']} for tensorflow)")
    p.add_argument("--report", nargs="?", const="", default=None, metavar="MD",
                   help="run nothing: regenerate MD (default --md) and --png from --data")
    p.add_argument("--no-doc", action="store_true", help="run and keep --out only; leave docs/ alone")
    p.add_argument("--note", default="", help="free text stored in each record and shown in the tables")
    p.add_argument("--timeout", type=float, default=4 * 3600, help="seconds per link run (default 4 h)")
    p.add_argument("--step-timeout", type=float, default=900,
                   help="seconds one compressor run may take inside a link run (default 900)")
    p.add_argument("--python", default=default_python(), help="python of the ranks (default: .venv's)")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    try:
        a.links = [step._link(link) for link in a.links]
    except argparse.ArgumentTypeError as e:
        p.error(str(e))
    if a.np < 1 or a.steps < 1 or a.warmup < 0 or a.rounds < 1 or a.tf_groups < 0:
        p.error("need --np >= 1, --steps >= 1, --warmup >= 0, --rounds >= 1, --tf-groups >= 0")
    step.check_framework_args(a, p.error)
    if a.compare_torch and a.framework != "tensorflow":
        p.error("--compare-torch is for --framework tensorflow")
    for name, default in FILES[a.framework].items():
        if getattr(a, name) is None:
            setattr(a, name, default)
    if a.report is not None:
        a.md = a.report or a.md
    return a


def link_command(a, link):
    """The netem.py command line of one link."""
    rate = "none" if link == "loopback" else link
    bench = [a.python, "-m", "horovod_sparse.bench.step", "--framework", a.framework, "--models", *a.models,
             "--compressors", *a.compressors, "--steps", str(a.steps), "--warmup", str(a.warmup),
             "--rounds", str(a.rounds), "--link", link, "--out", a.out, "--timeout", str(a.step_timeout)]
    if a.recipe:
        bench += ["--recipe", a.recipe]
    if a.model:
        bench += ["--model", ",".join(f"{k}={v}" for k, v in a.model.items())]
    if a.tf_groups:
        bench += ["--tf-groups", str(a.tf_groups)]
    if a.tf_api != "tape":
        bench += ["--tf-api", a.tf_api]
    if a.note:
        bench += ["--note", a.note]
    # "--mpirun-args=...": with a space argparse would read the value, which starts with "--",
    # as an option.
    return [a.python, os.path.join("scripts", "netem.py"), "--rate", rate, "-np", str(a.np),
            f"--mpirun-args={MPIRUN_ARGS}", "--"] + bench


def run_job(argv, env, timeout):
    """Run one netem.py job (a link of bench_step, a workload and link of bench_tta, a schedule
    of bench_schedule); on timeout interrupt it (netem.py then stops mpirun and removes its
    namespaces; SIGTERM alone would leave mpirun behind with ``--rate none``), then insist.
    Returns (exit status, timed out)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env)
    try:
        return proc.wait(timeout=timeout), False
    except subprocess.TimeoutExpired:
        print(f"[bench] timeout after {timeout:.0f} s, stopping this job", flush=True)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            proc.send_signal(sig)
            try:
                return proc.wait(timeout=60), True
            except subprocess.TimeoutExpired:
                continue
        return proc.wait(), True


def report(a):
    """Regenerate ``--png`` and ``--framework``'s block of ``--md`` from ``--data``."""
    recs = plot_step.load([a.data], a.framework) if os.path.exists(a.data) else []
    if not recs:
        print(f"[bench_step] no {a.framework} records in {a.data}", flush=True)
        return 1
    plot_step.plot(recs, a.png, a.framework)
    png = os.path.relpath(a.png, os.path.dirname(os.path.abspath(a.md)))
    plot_step.update_md(a.md, plot_step.section(recs, png, a.framework, a.compare_torch), a.framework)
    print(f"[bench_step] {len(recs)} {a.framework} records from {a.data} -> {a.md}, {a.png}", flush=True)
    return 0


def main(argv=None):
    a = parse_args(argv)
    os.chdir(REPO)
    if a.report is not None:
        return report(a)
    cmdline = shlex.join(["python", "scripts/bench_step.py"] + (sys.argv[1:] if argv is None else argv))
    env = {**os.environ, **RANK_ENV, step.DRIVER_ENV: cmdline}
    if not a.dry_run:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        open(a.out, "w").close()
    failed, start = [], time.monotonic()
    for link in a.links:
        argv_link = link_command(a, link)
        print(f"[bench_step] === link {link}, P={a.np} ({time.monotonic() - start:.0f} s so far): "
              f"{shlex.join(argv_link)}", flush=True)
        if a.dry_run:
            continue
        rc, _ = run_job(argv_link, env, a.timeout)
        if rc != 0:
            print(f"[bench_step] !!! link {link} failed (exit {rc})", flush=True)
            failed.append(link)
    print(f"[bench_step] done in {time.monotonic() - start:.0f} s"
          + (f"; failed: {' '.join(failed)}" if failed else ""), flush=True)
    if a.dry_run or a.no_doc:
        return 1 if failed else 0
    if os.path.getsize(a.out):
        os.makedirs(os.path.dirname(os.path.abspath(a.data)), exist_ok=True)
        shutil.copyfile(a.out, a.data)
        report(a)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
