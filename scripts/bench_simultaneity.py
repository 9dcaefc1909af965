#!/usr/bin/env python3
"""Measure the simultaneity factor k2 of two channels on a link (docs/results/scheduling.md, section 7).

ASC-WFBP runs two exchanges at once on two channels. Whether that pays depends on one
number of the link: two exchanges of M bytes started together end at ``a + k2*b*M``
instead of ``2a + 2bM`` one after the other (``k2 = 1``: the channels do not interfere;
``k2 = 2``: they split the link fairly and only start-ups overlap). The paper reports about
1.5 on its cluster; this measures it here, on the path a channel would use: a dense float32
sum (``MPI_Allreduce``) on a ``Dup()`` of the world communicator, one thread per channel
(the worker threads of the out-of-band runtime), at P ranks, under ``scripts/netem.py``.

    python scripts/bench_simultaneity.py --links loopback 1gbit 10gbit --np 2 \\
        --out docs/results/data/schedule/simultaneity.jsonl --md docs/results/scheduling.md

Per link and size M (float32, geometric): ``alone`` = one allreduce of M on channel 0,
``together`` = one allreduce of M on each of two channels started at once (time until both
are done); each the median over ``--repeats`` of the slowest rank, after a barrier. Then
``fit_simultaneity`` gives k2 (the ratio of the two fitted slopes) and R^2; the script also
plans the scheduling benchmark's model (its calibration in docs/results/data/schedule/) with that k2
and says what the simulator predicts for ``asc`` against the one-channel ``optimal`` plan.

``--worker`` is the MPI side (run by the driver under netem.py; needs MPI_THREAD_MULTIPLE).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "scripts"))

DEFAULT_SIZES = [2 ** e for e in range(16, 26, 2)]   # 64 KiB .. 16 MiB
CALIB = os.path.join(REPO, "docs", "results", "data", "schedule", "dense-p{np}.calib-{link}.json")
BLOCK = "simultaneity"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--links", nargs="+", default=["loopback", "1gbit", "10gbit"],
                   help="tc rates per rank link, or loopback (default: loopback 1gbit 10gbit)")
    p.add_argument("--np", type=int, default=2, help="MPI ranks (default 2)")
    p.add_argument("--sizes", nargs="+", type=int, default=DEFAULT_SIZES, help="bytes per exchange")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats per size (default 7)")
    p.add_argument("--out", default=os.path.join(REPO, "results", "simultaneity.jsonl"))
    p.add_argument("--md", help="write the results block into this markdown file")
    p.add_argument("--report", action="store_true", help="run nothing: report --out (and --md)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--link", default="loopback", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.np < 2:
        p.error("--np must be >= 2 (a channel exchanges between ranks)")
    if a.repeats < 1 or any(s < 4 for s in a.sizes):
        p.error("--repeats must be >= 1 and every size >= 4 bytes")
    return a


# ----------------------------------------------------------------------- MPI side
def worker(a):
    import numpy as np
    from mpi4py import MPI

    from horovod_sparse.agreement import max_over_ranks
    if MPI.Query_thread() != MPI.THREAD_MULTIPLE:
        raise SystemExit("bench_simultaneity: MPI does not provide MPI_THREAD_MULTIPLE; channels need it")
    world = MPI.COMM_WORLD
    channels = [world.Dup(), world.Dup()]
    rank = world.Get_rank()

    def slowest(seconds):
        return float(max_over_ranks(world, [seconds])[0])

    def allreduce(comm, send, recv):
        comm.Allreduce(send, recv, op=MPI.SUM)

    records = []
    for nbytes in a.sizes:
        n = max(1, nbytes // 4)
        bufs = [(np.ones(n, np.float32), np.empty(n, np.float32)) for _ in channels]
        alone, together = [], []
        for repeat in range(a.repeats + 1):   # the first is a warm-up
            world.Barrier()
            t0 = time.perf_counter()
            allreduce(channels[0], *bufs[0])
            t_alone = slowest(time.perf_counter() - t0)
            world.Barrier()
            threads = [threading.Thread(target=allreduce, args=(c, *b)) for c, b in zip(channels, bufs)]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            t_together = slowest(time.perf_counter() - t0)
            if repeat:
                alone.append(t_alone)
                together.append(t_together)
        if rank == 0:
            records.append(dict(bench="simultaneity", link=a.link, np=world.Get_size(), bytes=4 * n,
                                alone_s=statistics.median(alone), together_s=statistics.median(together),
                                repeats=a.repeats))
            print(f"[simultaneity] {a.link} P={world.Get_size()} {4 * n / 2**20:7.2f} MiB: alone "
                  f"{records[-1]['alone_s'] * 1e3:8.2f} ms, two at once {records[-1]['together_s'] * 1e3:8.2f} ms",
                  flush=True)
    if rank == 0:
        with open(a.out, "a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    for c in channels:
        c.Free()


# --------------------------------------------------------------------- driver side
def run_link(a, link):
    cmd = [sys.executable, os.path.join(REPO, "scripts", "netem.py"), "--rate", "none" if link == "loopback" else link,
           "-np", str(a.np), "--mpirun-args=--bind-to none --mca mpi_yield_when_idle 1", "--",
           sys.executable, os.path.abspath(__file__), "--worker", "--link", link, "--out", a.out,
           "--repeats", str(a.repeats), "--sizes", *map(str, a.sizes)]
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    print(f"[bench_simultaneity] link {link}, P={a.np}", flush=True)
    rc = subprocess.call(cmd, env=env, timeout=1800)
    if rc:
        raise SystemExit(f"bench_simultaneity: the {link} run failed (exit {rc})")


def summarize(records):
    """Per (link, P): the fits of alone and together, k2 and its R^2."""
    from horovod_sparse.schedule.cost import CostModel, fit_simultaneity
    groups = {}
    for r in records:
        groups.setdefault((r["link"], r["np"]), []).append(r)
    rows = []
    for (link, np_), rs in groups.items():
        rs.sort(key=lambda r: r["bytes"])
        sizes = [r["bytes"] for r in rs]
        alone, together = [r["alone_s"] for r in rs], [r["together_s"] for r in rs]
        one, r2_one = CostModel.fit(sizes, alone)
        k2, r2 = fit_simultaneity(sizes, alone, together)
        rows.append(dict(link=link, np=np_, a=one.a, b=one.b, r2_alone=r2_one, k2=k2, r2=r2,
                         largest=rs[-1], asc=asc_outlook(link, np_, k2)))
    return rows


def asc_outlook(link, np_, k2):
    """What the simulator predicts on the scheduling benchmark's model at this k2: the step
    of ``optimal`` (one channel) and of ``asc`` (two), from that benchmark's calibration."""
    path = CALIB.format(np=np_, link=link)
    if not os.path.exists(path):
        return None
    from horovod_sparse.schedule.cost import CostModel
    from horovod_sparse.schedule.planner import make_plan
    from horovod_sparse.schedule.simulate import ready_times, simulate
    with open(path) as f:
        calib = json.load(f)
    cost = CostModel(calib["fit"]["a"], calib["fit"]["b"])
    ready = ready_times(calib["compute_s"])
    end = ready[-1] + calib["tail_s"]
    steps = {}
    for schedule, channels in (("optimal", 1), ("asc", 2)):
        plan = make_plan(schedule, calib["compute_s"], calib["sizes"], cost, channels=2, simultaneity=k2)
        sim = simulate(ready, calib["sizes"], plan, cost, channels=channels, backward_end=end, simultaneity=k2)
        steps[schedule] = calib["batch_time_s"] + sim.overhead
    return steps


def markdown(rows, a):
    lines = ["Produced by:", "", "```bash",
             f"python scripts/bench_simultaneity.py --links {' '.join(dict.fromkeys(r['link'] for r in rows))} "
             f"--np {' '.join(sorted({str(r['np']) for r in rows}))} --out {os.path.relpath(a.out, REPO)}"
             + (f" --md {os.path.relpath(a.md, REPO)}" if a.md else ""), "```", "",
             "| link | P | alone: a + b*M | R^2 | largest M: alone / two at once | k2 | R^2 | "
             "predicted step, optimal / asc (benchmark model) |",
             "|---|---:|---|---:|---|---:|---:|---|"]
    for r in rows:
        big = r["largest"]
        gbps = 2 * (r["np"] - 1) / r["np"] * 8 / r["b"] / 1e9 if r["b"] > 0 else float("nan")
        outlook = "no calibration" if r["asc"] is None else (
            f"{r['asc']['optimal'] * 1e3:.1f} / {r['asc']['asc'] * 1e3:.1f} ms "
            f"({r['asc']['optimal'] / r['asc']['asc']:.2f}x)")
        lines.append(f"| {r['link']} | {r['np']} | {r['a'] * 1e3:.3f} ms + M / ({gbps:.2f} Gbit/s ring) | "
                     f"{r['r2_alone']:.4f} | {big['bytes'] / 2**20:.0f} MiB: {big['alone_s'] * 1e3:.1f} / "
                     f"{big['together_s'] * 1e3:.1f} ms | **{r['k2']:.2f}** | {r['r2']:.4f} | {outlook} |")
    return "\n".join(lines) + "\n"


def report(a):
    from doc_block import replace_block
    with open(a.out) as f:
        records = [json.loads(line) for line in f if line.strip()]
    rows = summarize(records)
    text = markdown(rows, a)
    print(text)
    if a.md:
        replace_block(a.md, BLOCK, text)


def main(argv=None):
    a = parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    if not a.report:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        open(a.out, "w").close()
        for link in a.links:
            run_link(a, link)
    report(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
