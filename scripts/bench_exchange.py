#!/usr/bin/env python3
"""Time the sparse allreduce algorithms of horovod_sparse.exchange.

Run under MPI, e.g. (plain loopback, or over emulated 1 Gbit/s links):

    mpirun --allow-run-as-root --oversubscribe -np 3 python scripts/bench_exchange.py --n 1000000
    python scripts/netem.py --rate 1gbit -np 3 -- python scripts/bench_exchange.py --out results/b.jsonl

Every rank draws k = density * n distinct random indices in [0, n) with random
float32 values (seeded per rank: ``--seed + rank``); the same inputs go to every
algorithm. Per algorithm: ``--warmup`` untimed calls, then ``--repeats`` timed calls,
each as ``Barrier(); t0; allreduce(); t1`` on every rank; a call's time is the maximum
of (t1 - t0) over ranks, and the reported time is the median over the repeats.
Traffic is what the engine counted for this rank (``res.traffic``), averaged over
the timed calls, reported as the max and the mean over ranks.

Rank 0 prints a table and appends one JSON object per algorithm to ``--out``.
When horovod_sparse.exchange cannot be imported, only ``dense`` is available,
done directly with mpi4py's ``Allreduce`` (traffic then comes from the ring model,
marked ``"traffic_source": "model"``).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import socket
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

# Run from a checkout without installing: make `horovod_sparse` importable.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

DEFAULT_ALGORITHMS = ("dense", "allgather", "oktopk", "gtopk", "dsa")
RATE_ENV = "HSP_NETEM_RATE"   # set by scripts/netem.py


def _load_engine():
    try:
        from horovod_sparse.exchange import ALGORITHMS, SparseAllreduce  # noqa: F401
        return SparseAllreduce, tuple(ALGORITHMS), None
    except Exception as e:  # ImportError, or a half-written module
        return None, ("dense",), f"{type(e).__name__}: {e}"


# ------------------------------------------------------------------ theory
def theory(algorithm: str, n: int, k: int, P: int, index_bytes=4, value_bytes=4):
    """Bytes sent per rank per call predicted by the Ok-Topk paper's table.

    The paper counts elements (an index-value pair is two elements); returned as
    (low, high) bytes with 4-byte indices and values unless told otherwise.
    """
    pair = index_bytes + value_bytes
    if P <= 1:
        return 0.0, 0.0
    if algorithm == "dense":
        v = 2.0 * n * (P - 1) / P * value_bytes
        return v, v
    if algorithm == "allgather":                      # TopkA: 2k(P-1) elements
        v = k * (P - 1) * pair
        return v, v
    if algorithm == "oktopk":                         # [2k(P-1)/P, 6k(P-1)/P) elements
        return k * (P - 1) / P * pair, 3.0 * k * (P - 1) / P * pair
    if algorithm == "gtopk":                          # 4k log2 P elements
        v = 2.0 * k * math.log2(P) * pair
        return v, v
    if algorithm == "dsa":                            # [4k(P-1)/P, (2k+n)(P-1)/P] elements
        return 2.0 * k * (P - 1) / P * pair, (2.0 * k + n) * (P - 1) / P * value_bytes
    return float("nan"), float("nan")


# ------------------------------------------------------------------ inputs
def make_inputs(n: int, k: int, seed: int, rank: int):
    rng = np.random.default_rng([seed, rank])
    idx = np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)
    vals = rng.standard_normal(k, dtype=np.float32)
    return idx, vals


class _DenseMPI:
    """Fallback 'dense' exchange: scatter into a dense buffer, MPI Allreduce."""

    class _Traffic:
        def __init__(self, s=0, r=0, m=0):
            self.bytes_sent, self.bytes_received, self.messages_sent = s, r, m

    class _Result:
        def __init__(self, dense, traffic):
            self.dense, self.traffic = dense, traffic

    def __init__(self, n, comm):
        self.n, self.comm = n, comm.Dup()
        self.buf = np.zeros(n, dtype=np.float32)

    def allreduce(self, indices, values):
        self.buf[:] = 0
        self.buf[indices] = values
        self.comm.Allreduce(MPI.IN_PLACE, self.buf, op=MPI.SUM)
        P = self.comm.Get_size()
        b = 2.0 * self.n * (P - 1) / P * 4 if P > 1 else 0.0
        return self._Result(self.buf, self._Traffic(b, b, 2 * (P - 1)))

    def close(self):
        self.comm.Free()


# ------------------------------------------------------------------ bench
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=25_000_000, help="gradient length (float32 elements)")
    p.add_argument("--density", type=float, default=0.01, help="k = density * n per rank")
    p.add_argument("--algorithms", default=",".join(DEFAULT_ALGORITHMS),
                   help="comma-separated list (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per algorithm")
    p.add_argument("--warmup", type=int, default=2, help="untimed calls first")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--rate", default=None,
                   help=f"link label for the record (default: ${RATE_ENV} set by netem.py, "
                        "else 'unknown')")
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument("--check", action="store_true",
                   help="compare the last result with a dense MPI reference sum (slow at large n)")
    a = p.parse_args(argv)
    if a.n < 1 or not (0 < a.density <= 1) or a.repeats < 1 or a.warmup < 0:
        p.error("need n >= 1, 0 < density <= 1, repeats >= 1, warmup >= 0")
    a.algorithms = [s.strip() for s in a.algorithms.split(",") if s.strip()]
    return a


def bench_one(make, algorithm, idx, vals, args, comm):
    ex = make()
    try:
        for _ in range(args.warmup):
            ex.allreduce(idx, vals)
        times, sent, recv, msgs, payload = [], [], [], [], []
        for _ in range(args.repeats):
            comm.Barrier()
            t0 = time.perf_counter()
            res = ex.allreduce(idx, vals)
            dt = time.perf_counter() - t0
            times.append(comm.allreduce(dt, op=MPI.MAX))
            tr = res.traffic
            sent.append(tr.bytes_sent)
            recv.append(tr.bytes_received)
            msgs.append(tr.messages_sent)
            payload.append(getattr(tr, "payload_bytes_sent", tr.bytes_sent))
        comm.Barrier()
        nnz = None if algorithm == "dense" else int(np.asarray(res.indices).size)
        err = check(res, algorithm, idx, vals, args.n, comm) if args.check else None
    finally:
        ex.close()
    mine = (float(np.mean(sent)), float(np.mean(recv)), float(np.mean(msgs)),
            float(np.mean(payload)))
    per_rank = comm.gather(mine, root=0)
    return times, per_rank, nnz, err


def check(res, algorithm, idx, vals, n, comm):
    """Max abs error of the last result against a dense MPI reference sum.

    dense/allgather/dsa must match everywhere; oktopk/gtopk (which keep only the
    selected entries) must match on the indices they return.
    """
    ref = np.zeros(n, dtype=np.float64)
    ref[idx] = vals
    comm.Allreduce(MPI.IN_PLACE, ref, op=MPI.SUM)
    if algorithm in ("oktopk", "gtopk"):
        ri = np.asarray(res.indices)
        e = float(np.max(np.abs(np.asarray(res.values, np.float64) - ref[ri]), initial=0.0))
    else:
        got = res.dense() if hasattr(res, "dense") and callable(res.dense) else res.dense
        e = float(np.max(np.abs(np.asarray(got, np.float64) - ref), initial=0.0))
    return comm.allreduce(e, op=MPI.MAX)


def main(argv=None):
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, P = comm.Get_rank(), comm.Get_size()
    SparseAllreduce, available, why = _load_engine()
    for a in args.algorithms:
        if a not in available:
            if rank == 0:
                msg = f"algorithm {a!r} not available (have {', '.join(available)})"
                if why:
                    msg += f"; horovod_sparse.exchange not importable: {why}"
                print(msg, file=sys.stderr)
            return 2
    rate = args.rate or os.environ.get(RATE_ENV, "unknown")
    k = max(1, int(round(args.density * args.n)))

    t_in = time.perf_counter()
    idx, vals = make_inputs(args.n, k, args.seed, rank)
    t_in = comm.allreduce(time.perf_counter() - t_in, op=MPI.MAX)

    records = []
    for algorithm in args.algorithms:
        if SparseAllreduce is not None:
            make = (lambda a=algorithm: SparseAllreduce(args.n, algorithm=a, k=k, average=False))
            engine = "horovod_sparse.exchange"
        else:
            make = (lambda: _DenseMPI(args.n, comm))
            engine = "mpi4py.Allreduce (engine not importable)"
        times, per_rank, nnz, err = bench_one(make, algorithm, idx, vals, args, comm)
        if rank != 0:
            continue
        sent = [r[0] for r in per_rank]
        recv = [r[1] for r in per_rank]
        msgs = [r[2] for r in per_rank]
        lo, hi = theory(algorithm, args.n, k, P)
        rec = {
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "algorithm": algorithm, "P": P, "rate": rate, "n": args.n,
            "density": args.density, "k": k, "dtype": "float32",
            "warmup": args.warmup, "repeats": args.repeats,
            "times_s": [round(t, 6) for t in times],
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "bytes_sent_per_rank_max": max(sent), "bytes_sent_per_rank_mean": float(np.mean(sent)),
            "bytes_received_per_rank_max": max(recv),
            "messages_sent_per_rank_max": max(msgs),
            "payload_bytes_sent_per_rank_max": max(r[3] for r in per_rank),
            "result_nnz": nnz, "check_max_abs_err": err,
            "theory_bytes_low": lo, "theory_bytes_high": hi,
            "traffic_source": "engine" if SparseAllreduce is not None else "model",
            "engine": engine, "input_gen_s": t_in,
            "host": socket.gethostname(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mpi": MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
            "command": shlex.join([os.path.relpath(sys.argv[0], _REPO)] + sys.argv[1:]),
        }
        records.append(rec)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
        print(f"[bench] {algorithm:9s} P={P} rate={rate} median {rec['median_s']:.4f} s "
              f"sent {rec['bytes_sent_per_rank_max'] / 1e6:.2f} MB/rank"
              + (f" nnz {nnz}" if nnz is not None else "")
              + (f" check err {err:.3g}" if err is not None else ""), flush=True)
    if rank == 0 and records and not args.no_table:
        print_table(records)
    return 0


def print_table(records):
    from rich.console import Console
    from rich.table import Table
    r0 = records[0]
    t = Table(title=f"n={r0['n']:,} float32, k={r0['k']:,} ({r0['density']}), P={r0['P']}, "
                    f"link {r0['rate']}: median of {r0['repeats']}, max over ranks")
    for col in ("algorithm", "median s", "min s", "sent MB/rank (max)", "recv MB/rank (max)",
                "msgs/rank", "theory MB/rank"):
        t.add_column(col, justify="left" if col == "algorithm" else "right")
    for r in records:
        lo, hi = r["theory_bytes_low"], r["theory_bytes_high"]
        th = f"{lo / 1e6:.2f}" if lo == hi else f"{lo / 1e6:.2f}..{hi / 1e6:.2f}"
        t.add_row(r["algorithm"], f"{r['median_s']:.4f}", f"{r['min_s']:.4f}",
                  f"{r['bytes_sent_per_rank_max'] / 1e6:.2f}",
                  f"{r['bytes_received_per_rank_max'] / 1e6:.2f}",
                  f"{r['messages_sent_per_rank_max']:.0f}", th)
    Console(width=140).print(t)


if __name__ == "__main__":
    sys.exit(main())
