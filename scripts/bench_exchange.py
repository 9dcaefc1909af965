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

Recorded selections instead (``--selections FILE --step S``, a file written by
``scripts/record_selections.py``): rank r exchanges the top-k selection of simulated rank r
of real training at recorded step S (n and k come from the file; P must not exceed the
ranks recorded), so the ranks' selections overlap as real ones do. Every record also holds
each timed call's counts per rank (``per_call``: bytes and messages each way, control bytes,
the result's entries) and the number of the first timed call (``first_call``: the calls
before it were the warm-up), so that a call that repartitions or computes an exact threshold
can be told apart.

Rank 0 prints a table and appends one JSON object per algorithm to ``--out``.

``--pingpong`` times MPI's own cost of one small message instead (the cost model's alpha,
:mod:`horovod_sparse.whatif.exchange_cost`, which timed exchanges hardly tell from the work
around it): ranks 0 and 1 bounce one int64 ``--repeats`` x 500 times; the record
(``"kind": "pingpong"``) holds the median one-way time.

``--transport horovod`` runs the exchanges over Horovod's own collectives instead of mpi4py
(:class:`horovod_sparse.horovod_collectives.HorovodCollectives`, as under ``horovodrun --gloo``;
Horovod initialised by ``horovod.torch``): every algorithm, Ok-Topk's and TopkDSA's posted
messages delivered by one alltoall per round, gTop-k's tree folded on every rank from
its inputs, gathered. ``--latency`` times one 8-byte Allreduce over the chosen transport
instead (the fixed cost of a collective; Horovod's includes its negotiation cycle): the record
(``"kind": "latency"``) holds the median seconds per Allreduce. Both transports side by side:

    mpirun -np 2 python scripts/bench_exchange.py --n 1000000 --algorithms dense,allgather
    mpirun -np 2 python scripts/bench_exchange.py --n 1000000 --transport horovod
    mpirun -np 2 python scripts/bench_exchange.py --latency --transport horovod

``--report RECORDS.jsonl`` (no MPI) reads such records back and prints, per algorithm and P,
the counted volume per rank and call against the closed forms of
:mod:`horovod_sparse.whatif.volumes`, from (n, k, P) alone and fed the data of
``--selections`` (markdown: printed, ``--table-out``, or a page's generated block,
``--page``), and plots it (``--plot``):

    python scripts/bench_exchange.py --report docs/results/data/oktopk-scale/counts.jsonl \
        --selections docs/results/data/oktopk-scale/selections.npz \
        --plot docs/results/oktopk-scale.png --page docs/results/oktopk-scale.md

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
    p.add_argument("--algorithms", default=None,
                   help=f"comma-separated list (default: {','.join(DEFAULT_ALGORITHMS)})")
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
    p.add_argument("--selections", default=None,
                   help="recorded selections (.npz of scripts/record_selections.py): rank r sends "
                        "simulated rank r's; n and k come from the file (with --report: the "
                        "data for the data-fed closed forms)")
    p.add_argument("--step", type=int, default=None,
                   help="which recorded step of --selections (default: the first)")
    p.add_argument("--transport", choices=("mpi", "horovod"), default="mpi",
                   help="mpi4py (default) or Horovod's collectives")
    p.add_argument("--latency", action="store_true",
                   help="time one 8-byte Allreduce over --transport instead (a collective's fixed cost)")
    p.add_argument("--pingpong", action="store_true",
                   help="time one small message between ranks 0 and 1 instead (the model's alpha)")
    p.add_argument("--report", default=None, metavar="RECORDS.jsonl",
                   help="no MPI: tabulate and plot counted volumes against the closed forms")
    p.add_argument("--plot", default=None, help="with --report: save the plot here (.png)")
    p.add_argument("--table-out", default=None, help="with --report: write the markdown tables here")
    p.add_argument("--page", default=None,
                   help="with --report: rewrite the page's <!-- oktopk-scale:begin/end --> block "
                        "with the tables (scripts/doc_block.py)")
    a = p.parse_args(argv)
    if a.n < 1 or not (0 < a.density <= 1) or a.repeats < 1 or a.warmup < 0:
        p.error("need n >= 1, 0 < density <= 1, repeats >= 1, warmup >= 0")
    if a.algorithms is None:
        a.algorithms = ",".join(DEFAULT_ALGORITHMS)
    a.algorithms = [s.strip() for s in a.algorithms.split(",") if s.strip()]
    if a.transport == "horovod" and a.pingpong:
        p.error("--pingpong sends point-to-point messages, which Horovod's collectives do not carry: use --latency")
    return a


#: per call and rank: the Traffic fields kept in a record's ``per_call``
CALL_FIELDS = ("bytes_sent", "bytes_received", "messages_sent", "messages_received",
               "control_bytes_sent")


def bench_one(make, algorithm, idx, vals, args, comm):
    ex = make()
    try:
        for _ in range(args.warmup):
            ex.allreduce(idx, vals)
        times, sent, recv, msgs, payload, calls = [], [], [], [], [], []
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
            nnz_call = None if algorithm == "dense" else int(np.asarray(res.indices).size)
            calls.append(([int(getattr(tr, f, 0)) for f in CALL_FIELDS], nnz_call))
        comm.Barrier()
        nnz = None if algorithm == "dense" else int(np.asarray(res.indices).size)
        err = check(res, algorithm, idx, vals, args.n, comm) if args.check else None
    finally:
        ex.close()
    mine = (float(np.mean(sent)), float(np.mean(recv)), float(np.mean(msgs)),
            float(np.mean(payload)), calls)
    per_rank = comm.gather(mine, root=0)
    return times, per_rank, nnz, err


def pingpong(comm, args, rate, bounces=500):
    """Ranks 0 and 1 bounce one int64 ``bounces`` times per repeat (the others wait): the
    median one-way seconds of a small message, appended to ``--out`` by rank 0."""
    rank = comm.Get_rank()
    if comm.Get_size() < 2:
        print("--pingpong needs at least 2 ranks", file=sys.stderr)
        return 2
    mine, other = np.zeros(1, np.int64), np.zeros(1, np.int64)
    times = []
    for _ in range(args.warmup + args.repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(bounces if rank < 2 else 0):
            if rank == 0:
                comm.Send(mine, 1, 7)
                comm.Recv(other, 1, 7)
            else:
                comm.Recv(other, 0, 7)
                comm.Send(mine, 0, 7)
        times.append((time.perf_counter() - t0) / (2 * bounces))
    times = times[args.warmup:]
    if rank == 0:
        rec = {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "kind": "pingpong", "P": comm.Get_size(), "rate": rate, "bytes": 8, "bounces": bounces,
               "times_s": [round(t, 9) for t in times], "median_s": statistics.median(times),
               "host": socket.gethostname(), "cpus": os.cpu_count(),
               "mpi": MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
               "command": shlex.join([os.path.relpath(sys.argv[0], _REPO)] + sys.argv[1:])}
        append_record(args.out, rec)
        print(f"[bench] pingpong rate={rate}: one small message {rec['median_s'] * 1e6:.1f} us (median)", flush=True)
    return 0


def append_record(path, rec):
    """Append ``rec`` as one JSON line to ``path`` (``--out``; nothing when it is None)."""
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(rec) + "\n")


def exchange_comm(transport):
    """The communicator the exchanges run on: None (the engine's own mpi4py world) or
    Horovod's collectives among Horovod's ranks."""
    if transport == "mpi":
        return None
    import horovod.torch as hvd
    from horovod_sparse.horovod_collectives import HorovodCollectives
    hvd.init()
    return HorovodCollectives(hvd, reason="bench_exchange --transport horovod")


def latency(comm, xcomm, args, rate, calls=500):
    """Median seconds of one 8-byte Allreduce (``calls`` per repeat) over mpi4py (``xcomm``
    None) or Horovod's collectives, appended to ``--out`` by rank 0."""
    over = comm.Dup() if xcomm is None else xcomm
    mine, out = np.ones(1, np.int64), np.zeros(1, np.int64)
    times = []
    for _ in range(args.warmup + args.repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            over.Allreduce(mine, out, op=MPI.SUM)
        times.append(comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
    assert int(out[0]) == comm.Get_size(), out  # the sum arrived
    times = times[args.warmup:]
    if xcomm is None:
        over.Free()
    if comm.Get_rank() == 0:
        rec = {"timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
               "kind": "latency", "transport": args.transport, "P": comm.Get_size(), "rate": rate,
               "bytes": 8, "calls": calls, "times_s": [round(t, 9) for t in times],
               "median_s": statistics.median(times), "host": socket.gethostname(), "cpus": os.cpu_count(),
               "command": shlex.join([os.path.relpath(sys.argv[0], _REPO)] + sys.argv[1:])}
        append_record(args.out, rec)
        print(f"[bench] latency {args.transport} P={rec['P']} rate={rate}: one 8-byte Allreduce "
              f"{rec['median_s'] * 1e6:.1f} us (median)", flush=True)
    return 0


def per_call_record(per_rank):
    """``[{field: [per rank], "result_nnz": int}, ...]``, one entry per timed call."""
    out = []
    for c in range(len(per_rank[0][4])):
        entry = {f: [r[4][c][0][i] for r in per_rank] for i, f in enumerate(CALL_FIELDS)}
        entry["result_nnz"] = per_rank[0][4][c][1]
        out.append(entry)
    return out


def load_selections(path, step=None):
    """``(indices (P, k) int32, values (P, k) float32, step, n, k, meta)`` of one recorded step."""
    with np.load(path) as f:
        steps = f["steps"].tolist()
        step = steps[0] if step is None else int(step)
        if step not in steps:
            raise SystemExit(f"step {step} is not recorded in {path} (have {steps})")
        row = steps.index(step)
        return (f["indices"][row], f["values"][row], step, int(f["n"]), int(f["k"]),
                json.loads(str(f["meta"])))


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
    if args.report:
        return report(args)
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
    if args.pingpong:
        return pingpong(comm, args, rate)
    xcomm = exchange_comm(args.transport)
    if args.latency:
        return latency(comm, xcomm, args, rate)
    t_in = time.perf_counter()
    inputs = "uniform random"
    if args.selections:
        sel_idx, sel_vals, args.step, args.n, k, _ = load_selections(args.selections, args.step)
        if P > sel_idx.shape[0]:
            if rank == 0:
                print(f"{args.selections} holds {sel_idx.shape[0]} ranks, fewer than P = {P}",
                      file=sys.stderr)
            return 2
        args.density = k / args.n
        idx, vals = sel_idx[rank].astype(np.int64), np.ascontiguousarray(sel_vals[rank])
        inputs = f"selections {os.path.relpath(os.path.abspath(args.selections), _REPO)} step {args.step}"
        del sel_idx, sel_vals
    else:
        k = max(1, int(round(args.density * args.n)))
        idx, vals = make_inputs(args.n, k, args.seed, rank)
    t_in = comm.allreduce(time.perf_counter() - t_in, op=MPI.MAX)

    records = []
    for algorithm in args.algorithms:
        if SparseAllreduce is not None:
            make = (lambda a=algorithm: SparseAllreduce(args.n, algorithm=a, k=k, average=False, comm=xcomm))
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
            "algorithm": algorithm, "transport": args.transport, "P": P, "rate": rate, "n": args.n,
            "density": args.density, "k": k, "dtype": "float32",
            "warmup": args.warmup, "repeats": args.repeats,
            "times_s": [round(t, 6) for t in times],
            "median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "bytes_sent_per_rank_max": max(sent), "bytes_sent_per_rank_mean": float(np.mean(sent)),
            "bytes_received_per_rank_max": max(recv),
            "messages_sent_per_rank_max": max(msgs),
            "payload_bytes_sent_per_rank_max": max(r[3] for r in per_rank),
            "inputs": inputs, "selections_step": args.step if args.selections else None,
            "first_call": args.warmup, "per_call": per_call_record(per_rank),
            "result_nnz": nnz, "check_max_abs_err": err,
            "theory_bytes_low": lo, "theory_bytes_high": hi,
            "traffic_source": "engine" if SparseAllreduce is not None else "model",
            "engine": engine, "input_gen_s": t_in,
            "host": socket.gethostname(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "mpi": MPI.Get_library_version().strip("\x00 \n").splitlines()[0],
            "command": shlex.join([os.path.relpath(sys.argv[0], _REPO)] + sys.argv[1:]),
        }
        records.append(rec)
        append_record(args.out, rec)
        print(f"[bench] {algorithm:9s} {args.transport:7s} P={P} rate={rate} median {rec['median_s']:.4f} s "
              f"sent {rec['bytes_sent_per_rank_max'] / 1e6:.2f} MB/rank"
              + (f" nnz {nnz}" if nnz is not None else "")
              + (f" check err {err:.3g}" if err is not None else ""), flush=True)
    if rank == 0 and records and not args.no_table:
        print_table(records)
    return 0


# ------------------------------------------------------------------ report (no MPI)
def closed_forms(algorithm, n, k, P, call, nnz=None, data=None):
    """Per-rank :class:`~horovod_sparse.whatif.volumes.Volume` lists of one call: from (n, k, P)
    alone (the uniform model) and, with ``data`` = (the P ranks' index arrays, value arrays),
    fed the quantities the data decide (regions, overlaps, selected counts)."""
    from horovod_sparse.whatif import volumes as vol
    model_kw, data_kw = {}, {}
    if algorithm == "oktopk":
        repartition, exact = vol.oktopk_schedule(call)
        model_kw = data_kw = dict(repartition=repartition, exact=exact)
    if algorithm == "gtopk" and nnz is not None:
        model_kw = data_kw = dict(selected=nnz)
    model = [vol.volume(algorithm, n, k, P, r, **model_kw) for r in range(P)]
    if data is None:
        return model, None
    selections, values = data
    if algorithm == "dsa":
        data_kw = dict(stats=vol.data_stats(selections, [(j * n) // P for j in range(P + 1)]))
    elif algorithm == "oktopk":
        bounds = vol.oktopk_bounds(selections, n)
        data_kw = dict(data_kw, stats=vol.data_stats(selections, bounds),
                       selected_per_region=vol.selected_per_region(selections, values, bounds, k))
    return model, [vol.volume(algorithm, n, k, P, r, **data_kw) for r in range(P)]


def report_rows(records, selections=None):
    """One row per (algorithm, P, call) of the records that used recorded selections."""
    from horovod_sparse.whatif import volumes as vol
    rows, cache = [], {}
    for rec in records:
        n, k, P, alg = rec["n"], rec["k"], rec["P"], rec["algorithm"]
        data = None
        if selections is not None and rec.get("selections_step") is not None:
            key = (rec["selections_step"], P)
            if key not in cache:
                idx, vals, *_ = load_selections(selections, rec["selections_step"])
                cache[key] = ([np.asarray(i, np.int64) for i in idx[:P]], list(vals[:P]))
            data = cache[key]
        for c, call in enumerate(rec["per_call"]):
            number = rec.get("first_call", 0) + c
            model, fed = closed_forms(alg, n, k, P, number, call.get("result_nnz"), data)
            sent = np.array(call["bytes_sent"], float)
            row = {"algorithm": alg, "P": P, "call": number, "n": n, "k": k,
                   "step": rec.get("selections_step"), "nnz": call.get("result_nnz"),
                   "sent_mean": sent.mean(), "sent_max": sent.max(),
                   "received_mean": float(np.mean(call["bytes_received"])),
                   "messages_mean": float(np.mean(call["messages_sent"])),
                   "messages_max": float(np.max(call["messages_sent"])),
                   "model_sent": float(np.mean([v.bytes_sent for v in model])),
                   "model_messages": float(np.mean([v.messages_sent for v in model])),
                   "paper_bytes": 4.0 * vol.paper_elements(alg, n, k, P)}
            if fed is not None:
                exact = all(float(v.bytes_sent) == s and float(v.bytes_received) == r
                            and float(v.messages_sent) == m
                            for v, s, r, m in zip(fed, call["bytes_sent"], call["bytes_received"],
                                                  call["messages_sent"]))
                row.update(data_sent=float(np.mean([v.bytes_sent for v in fed])),
                           data_messages=float(np.mean([v.messages_sent for v in fed])),
                           data_exact_every_rank=exact)
            rows.append(row)
    return rows


def _same_counts(a, b):
    keys = ("sent_mean", "sent_max", "received_mean", "messages_mean", "nnz")
    return all(a[x] == b[x] for x in keys)


def volume_table(rows, step):
    """Markdown: per algorithm and P, the counted volume at recorded step ``step`` against the
    closed forms (calls with identical counts shown once, as "all")."""
    head = ("| algorithm | P | call | sent B/rank (mean) | sent (busiest rank) | received (mean) | "
            "messages sent: mean / busiest (closed form) | closed form from (n, k, P) | ratio | closed form fed "
            "the data | ratio | paper (elements x 4 B) | counted / paper |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    mine = [r for r in rows if r["step"] == step]
    for alg in _labels():
        for P in sorted({r["P"] for r in mine if r["algorithm"] == alg}):
            calls = sorted((r for r in mine if r["algorithm"] == alg and r["P"] == P),
                           key=lambda r: r["call"])
            if all(_same_counts(calls[0], c) for c in calls[1:]):
                calls = [dict(calls[0], call="all")]
            for r in calls:
                fed = (f"{r['data_sent']:,.0f}{'' if r['data_exact_every_rank'] else ' (not every rank)'} | "
                       f"{r['sent_mean'] / r['data_sent']:.4f}") if "data_sent" in r else "- | -"
                lines.append(
                    f"| {_labels()[alg]} | {P} | {r['call']} | {r['sent_mean']:,.0f} | {r['sent_max']:,.0f} | "
                    f"{r['received_mean']:,.0f} | {r['messages_mean']:.1f} / {r['messages_max']:.0f} "
                    f"({r['model_messages']:.1f}) | "
                    f"{r['model_sent']:,.0f} | {r['sent_mean'] / r['model_sent']:.4f} | {fed} | "
                    f"{r['paper_bytes']:,.0f} | {r['sent_mean'] / r['paper_bytes']:.3f} |")
    return "\n".join(lines) + "\n"


def ratio_table(rows):
    """Markdown: counted / closed form from (n, k, P), range over the recorded steps, per
    algorithm (Ok-Topk: its first and its later calls) and P."""
    Ps = sorted({r["P"] for r in rows})
    steps = sorted({r["step"] for r in rows if r["step"] is not None})
    head = "| algorithm | " + " | ".join(f"P = {p}" for p in Ps) + " |"
    lines = [f"counted / closed form from (n, k, P), bytes sent per rank (mean over ranks); "
             f"lowest-highest over the recorded steps {', '.join(map(str, steps))}", "",
             head, "|" + " --- |" * (len(Ps) + 1)]
    variants = []
    for alg in _labels():
        if alg == "oktopk":
            variants += [(alg, "first call", lambda r: r["call"] == 0),
                         (alg, "later call", lambda r: r["call"] > 0)]
        else:
            variants.append((alg, "", lambda r: True))
    for alg, label, keep in variants:
        cells = []
        for P in Ps:
            q = [r["sent_mean"] / r["model_sent"] for r in rows
                 if r["algorithm"] == alg and r["P"] == P and keep(r)]
            cells.append("-" if not q else f"{min(q):.3f}" if round(min(q), 3) == round(max(q), 3)
                         else f"{min(q):.3f}-{max(q):.3f}")
        if cells and any(c != "-" for c in cells):
            name = _labels()[alg] + (f", {label}" if label else "")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    fed = [r for r in rows if "data_sent" in r]
    if fed:
        exact = all(r["data_exact_every_rank"] for r in fed)
        lines += ["", f"closed form fed the data: {len(fed)} (algorithm, P, step, call) cases, "
                  + ("equal to the counters on every rank (bytes each way, messages sent)" if exact
                     else "NOT equal to the counters on every rank")]
    return "\n".join(lines) + "\n"


def causes_table(records, selections, step):
    """Markdown: the data-decided quantities behind the differences from the (n, k, P) forms,
    at recorded step ``step``: the union of the selections against the independent-uniform
    one (TopkDSA), TopkDSA's dense regions, and Ok-Topk's extra bytes per rank from its first
    phase (fewer own entries in the own region than k/P) and from the balancing moves."""
    from horovod_sparse.whatif import volumes as vol
    idx, vals, *_ = load_selections(selections, step)
    n, k = records[0]["n"], records[0]["k"]
    head = ("| P | union of the selections | uniform model's union | ratio | TopkDSA regions sent dense | "
            "Ok-Topk phase 1 extra B/rank | Ok-Topk balancing B/rank | Ok-Topk extra, total | "
            "own region / (k/P), mean (min-max) |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for P in sorted({r["P"] for r in records}):
        sel = [np.asarray(i, np.int64) for i in idx[:P]]
        union = np.unique(np.concatenate(sel)).size
        model_union = vol.uniform_union(n, k, P)
        equal = vol.data_stats(sel, [(j * n) // P for j in range(P + 1)])
        dense_regions = sum(1 for u, length in zip(equal.union, equal.length) if u * 8 > length * 4)
        bounds = vol.oktopk_bounds(sel, n)
        st = vol.data_stats(sel, bounds)
        spr = vol.selected_per_region(sel, list(vals[:P]), bounds, k)
        phase1 = np.mean([(c - o) * 8 for c, o in zip(st.counts, st.own)]) - 8 * k * (P - 1) / P
        balancing = np.mean([vol.balance(spr, P, r, 8).bytes_sent for r in range(P)]) \
            - np.mean([vol.balance(vol.equal_parts(k, P), P, r, 8).bytes_sent for r in range(P)])
        share = [o / (k / P) for o in st.own]
        lines.append(f"| {P} | {union:,} | {model_union:,.0f} | {union / model_union:.3f} | "
                     f"{dense_regions} of {P} | {phase1:,.0f} | {balancing:,.0f} | "
                     f"{phase1 + balancing:,.0f} | {np.mean(share):.3f} ({min(share):.3f}-{max(share):.3f}) |")
    return f"what the data decide, recorded step {step}\n\n" + "\n".join(lines) + "\n"


def markdown_table(rows, step=None):
    steps = sorted({r["step"] for r in rows if r["step"] is not None}) or [None]
    step = steps[len(steps) // 2] if step is None else step
    return (f"recorded step {step}\n\n" + volume_table(rows, step) + "\n" + ratio_table(rows)), step


def _labels():
    from horovod_sparse.whatif.volumes import LABELS
    return LABELS


def plot_rows(rows, path, step=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    steady = [r for r in rows if (r["algorithm"] != "oktopk" or r["call"] > 0)
              and (step is None or r["step"] == step)]
    fig, (ax, am) = plt.subplots(1, 2, figsize=(11, 4.2))
    for i, alg in enumerate(_labels()):
        mine = sorted((r for r in steady if r["algorithm"] == alg), key=lambda r: r["P"])
        by_p = {}
        for r in mine:  # one point per P (a later call: Ok-Topk's first one also repartitions)
            by_p.setdefault(r["P"], r)
        if not by_p:
            continue
        ps = sorted(by_p)
        color = f"C{i}"
        ax.plot(ps, [by_p[p]["sent_mean"] for p in ps], "o-", color=color, label=f"{_labels()[alg]} counted")
        ax.plot(ps, [by_p[p]["model_sent"] for p in ps], "--", color=color, alpha=0.6)
        ax.plot(ps, [by_p[p]["paper_bytes"] for p in ps], ":", color=color, alpha=0.6)
        am.plot(ps, [by_p[p]["messages_mean"] for p in ps], "o-", color=color, label=_labels()[alg])
    r0 = rows[0]
    ax.set(xscale="log", yscale="log", xlabel="P (ranks)", ylabel="bytes sent per rank per call (mean)")
    fig.suptitle(f"n = {r0['n']:,}, k = {r0['k']:,}, recorded step {step}: counted (o), closed form "
                 "from (n, k, P) (--), the paper's elements x 4 B (:, TopkDSA: its upper end)", fontsize=9)
    am.set(xscale="log", xlabel="P (ranks)", ylabel="messages sent per rank per call (mean)")
    for a in (ax, am):
        a.set_xticks(sorted({r["P"] for r in rows}))
        a.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        a.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())
        a.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def report(args):
    with open(args.report) as f:
        records = [json.loads(line) for line in f if line.strip()]
    records = [r for r in records if r.get("per_call")]
    if not records:
        print(f"no records with per-call counts in {args.report}", file=sys.stderr)
        return 2
    rows = report_rows(records, args.selections)
    table, step = markdown_table(rows, args.step)
    if args.selections and step is not None:
        table += "\n" + causes_table(records, args.selections, step)
    print(table)
    if args.table_out:
        with open(args.table_out, "w") as f:
            f.write(table)
    if args.page:
        sys.path.insert(0, os.path.join(_REPO, "scripts"))
        from doc_block import replace_block
        replace_block(args.page, "oktopk-scale", table)
    if args.plot:
        plot_rows(rows, args.plot, step)
        print(f"[report] plot {args.plot}")
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
