#!/usr/bin/env python3
"""Measured validation of the schedule planners and simulator (docs/results/scheduling.md section 6):
dense training through the stock ``hvd.DistributedOptimizer`` (``hvd.Compression.none``),
Horovod's default fusion against one allreduce per planned group (``groups=`` from
``horovod_groups`` and its environment), predicted by the simulator beside measured.

    python scripts/bench_schedule.py                       # 1gbit and 10gbit at P = 2 (root, for netem)
    python scripts/bench_schedule.py --links loopback --schedules default wfbp \\
        --warmup 1 --steps 2 --delay-scale 0.1 --no-doc     # a quick harness check
    python scripts/bench_schedule.py --cost table --no-doc --out results/schedule-table.jsonl
                                                           # plans priced by the measured fit points
    python scripts/bench_schedule.py --report              # only regenerate the doc and the PNG

Per link the driver launches ``scripts/netem.py --rate R -np N -- python
scripts/bench_schedule.py --worker ...`` several times (``loopback`` is ``--rate none``):

1. ``--worker calibrate``: the ranks measure the model's backward trace (gradient-hook
   timestamps, ``whatif.profile.measure_backward``; max over ranks) and fit Horovod's
   allreduce ``a + b*M`` on the link (``hvd.allreduce`` of float32 tensors at geometric
   sizes, each timed as a train of back-to-back calls, median over repeats of the max
   over ranks); rank 0 writes both to a JSON file.
2. ``--worker run --schedule S`` once per schedule, in a fresh job each, because Horovod
   reads ``HOROVOD_DISABLE_GROUP_FUSION`` and ``HOROVOD_FUSION_THRESHOLD`` at
   ``hvd.init()``: every rank reads the calibration file and makes the same plan
   (``make_plan``, deterministic), runs warm-up + timed steps (barrier before each; the
   step time is the max over ranks of zero_grad + forward + backward + ``opt.step()``,
   the record the median), and predicts the step: the step without communication
   (calibration's ``batch_time``) plus the simulator's overhead (``simulate`` for a plan,
   ``simulate_cycles`` with Horovod 0.28.1's defaults, 1 ms cycle and 128 MiB, for
   ``default``). At the end the ranks compare a hash of their parameters.

The model: Linear layers of varied sizes whose backward sleeps a fixed time per layer (a
custom autograd function; ``time.sleep`` releases the GIL, so Horovod's background thread
communicates meanwhile, as it would during real compute). Records are JSON lines in
``--out`` (emptied first), copied to ``--data``; ``--report`` regenerates the block
between ``<!-- schedule:begin -->`` and ``<!-- schedule:end -->`` in ``--md`` and ``--png``.
Only one-channel schedules are measured: Horovod runs one collective at a time, so ``asc``
(simultaneous channels) cannot be run through ``groups=``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shlex
import shutil
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "scripts")]  # the package, and doc_block / bench_step beside this file
# the schedules' steady steps: a compressor's warm-up (horovod_sparse.warmup) would run its dense
# steps on Horovod's allreduce first, and the schedule's profiling only after them
os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")

from horovod_sparse.agreement import max_over_ranks  # noqa: E402  (numpy only at import)
from horovod_sparse.bench.step import _link, link_bps  # noqa: E402  (stdlib only at import)
from doc_block import markers, replace_block  # noqa: E402
from bench_step import default_python, run_job  # noqa: E402

#: What one run measures: Horovod's own fusion, then the one-channel plans.
SCHEDULES = ("default", "after_backward", "wfbp", "mgwfbp", "optimal")
#: With --compressor: Horovod's own fusion (dense, the reference), then the compressor with
#: each of its schedules, ASC's two channels and "auto" included.
COMPRESSOR_SCHEDULES = SCHEDULES + ("asc", "auto")
#: The compressor's profiled steps before it plans, and "auto"'s steps per candidate plan
#: before it keeps the fastest (all part of the warm-up).
PROFILE_STEPS = 2
TRIAL_STEPS = 5
#: Horovod 0.28.1's background loop defaults (HOROVOD_CYCLE_TIME 1 ms, fusion 128 MiB), as
#: horovod_sparse.whatif.model assumes them.
HOROVOD_CYCLE_S = 0.001
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024
#: The model, in forward order: (in, out, backward sleep in ms). Sizes vary (64 KiB biases
#: to an 8 MiB weight) so the plans differ; at 1 Gbit/s the 15.7 MB of gradients take about
#: 2x the backward's 60 ms, so overlap matters.
LAYERS = ((1024, 1024, 10), (1024, 256, 8), (256, 256, 6), (256, 256, 6), (256, 256, 6),
          (256, 256, 6), (256, 1024, 8), (1024, 2048, 10))
BATCH = 32
RANK_ENV = {"OMP_NUM_THREADS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
            "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
MPIRUN_ARGS = "--bind-to none --mca mpi_yield_when_idle 1"
#: Horovod settings the driver must not pass on: "default" means Horovod's defaults.
HOROVOD_KNOBS = ("HOROVOD_DISABLE_GROUP_FUSION", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME")
DRIVER_ENV = "HSP_BENCH_DRIVER_COMMAND"
BEGIN, END = markers("schedule")


def _positive(text):
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text):
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _scale(text):
    v = float(text)
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def build_parser():
    p = argparse.ArgumentParser(prog="bench_schedule.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--np", type=_positive, default=2, help="MPI ranks (default 2)")
    p.add_argument("--links", nargs="+", type=_link, default=["1gbit", "10gbit"],
                   help="tc rates per rank link, or loopback (default: 1gbit 10gbit)")
    p.add_argument("--schedules", nargs="+", choices=COMPRESSOR_SCHEDULES, default=None,
                   help="default: all of " + " ".join(SCHEDULES) + " (with --compressor also asc auto)")
    p.add_argument("--cycle-ms", type=float, default=None,
                   help="HOROVOD_CYCLE_TIME for the compressor's own schedules only ('default' keeps "
                        "Horovod's 1 ms): Horovod's background thread coordinates over MPI every cycle, "
                        "which competes with the channel threads (docs/results/scheduling.md section 8)")
    p.add_argument("--compressor", default=None,
                   help="run this out-of-band compressor's own schedules (e.g. oktopk:density=0.01, "
                        "dense) instead of Horovod's groups=; 'default' stays Horovod's own dense fusion")
    p.add_argument("--steps", type=_positive, default=10, help="timed steps per schedule (default 10)")
    p.add_argument("--warmup", type=_non_negative, default=3, help="warm-up steps (default 3)")
    p.add_argument("--delay-scale", type=_scale, default=1.0,
                   help="multiplies every layer's backward sleep (default 1)")
    p.add_argument("--cost", choices=("line", "table"), default="line",
                   help="what plans and predictions use: the fitted line a + b*M (default) or the "
                        "measured fit points, interpolated")
    p.add_argument("--fit-repeats", type=_positive, default=5, help="allreduces per fitted size (default 5)")
    p.add_argument("--out", default="results/schedule.jsonl", help="records of this run (emptied first)")
    p.add_argument("--data", default="docs/results/data/schedule/dense-p2.jsonl", help="where the records are kept")
    p.add_argument("--md", default="docs/results/scheduling.md", help="doc whose schedule block is regenerated")
    p.add_argument("--png", default="docs/results/data/schedule/steps.png", help="plot of predicted vs measured")
    p.add_argument("--report", action="store_true", help="run nothing: regenerate --md and --png from --data")
    p.add_argument("--no-doc", action="store_true", help="run and keep --out only; leave docs/ alone")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launched job (default 300)")
    p.add_argument("--python", default=default_python(), help="python of the ranks (default: .venv's)")
    # what the driver passes to the rank processes
    p.add_argument("--worker", choices=("calibrate", "run"), help=argparse.SUPPRESS)
    p.add_argument("--schedule", choices=COMPRESSOR_SCHEDULES, help=argparse.SUPPRESS)
    p.add_argument("--link", type=_link, default="loopback", help=argparse.SUPPRESS)
    p.add_argument("--calib", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None):
    p = build_parser()
    a = p.parse_args(argv)
    if a.schedules is None:
        a.schedules = list(COMPRESSOR_SCHEDULES if a.compressor else SCHEDULES)
    if a.compressor is None and set(a.schedules) - set(SCHEDULES):
        p.error("--schedules asc and auto run two channels, which Horovod's groups= cannot: "
                "they need --compressor (e.g. --compressor dense)")
    if a.compressor is not None:
        from horovod_sparse import registry
        try:
            if not getattr(registry.create(a.compressor), "out_of_band", False):
                p.error(f"--compressor {a.compressor}: only out-of-band compressors have schedules")
        except ValueError as e:
            p.error(f"--compressor: {e}")
    if a.worker == "run" and (a.schedule is None or a.calib is None):
        p.error("--worker run needs --schedule and --calib")
    if a.worker == "calibrate" and a.calib is None:
        p.error("--worker calibrate needs --calib")
    return a


# ------------------------------------------------------------------------- the model
def build_model(delay_scale):
    """The Linear stack with sleeping backward; returns (model, loss_fn, make_batch)."""
    import torch
    from torch import nn

    class Sleep(torch.autograd.Function):
        """Identity forward; backward sleeps (the layer's compute, GIL released)."""

        @staticmethod
        def forward(ctx, x, seconds):
            ctx.seconds = seconds
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            if ctx.seconds > 0:
                time.sleep(ctx.seconds)
            return grad, None

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.ModuleList([nn.Linear(i, o) for i, o, _ in LAYERS])
            self.delays = [d * delay_scale / 1e3 for _, _, d in LAYERS]

        def forward(self, x):
            for k, (fc, d) in enumerate(zip(self.fc, self.delays)):
                x = fc(x)
                if k < len(self.fc) - 1:
                    x = torch.relu(x)
                x = Sleep.apply(x, d)
            return x

    def make_batch(seed):
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(BATCH, LAYERS[0][0], generator=gen), torch.randn(BATCH, LAYERS[-1][1], generator=gen)

    return Net(), torch.nn.functional.mse_loss, make_batch


def model_desc():
    return (f"{len(LAYERS)} Linear " + "-".join(str(w) for w in [LAYERS[0][0]] + [o for _, o, _ in LAYERS])
            + ", backward sleeps " + "/".join(str(d) for _, _, d in LAYERS) + f" ms, batch {BATCH}, MSE")


# ------------------------------------------------------------------------ rank side
class Ranks:
    """Horovod plus a private mpi4py communicator for barriers and max-over-ranks."""

    def __init__(self):
        import horovod.torch as hvd
        hvd.init()
        from mpi4py import MPI   # after hvd.init(): Horovod initialises MPI (thread multiple)
        self.hvd = hvd
        self.comm = MPI.COMM_WORLD.Dup()   # ours alone, beside Horovod's
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()

    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def max(self, values):
        return max_over_ranks(self.comm, values).tolist()


def fit_sizes(total_bytes):
    """Geometric sizes (x4) from 16 KiB to the model's gradient bytes."""
    sizes, m = [], 16 * 1024
    while m < total_bytes:
        sizes.append(m)
        m *= 4
    return sizes + [int(total_bytes)]


def train_length(nbytes):
    """Allreduces per fit timing: enough for 8 MiB in all, 2 to 32."""
    return int(min(32, max(2, -(-8 * 1024 * 1024 // nbytes))))


def calibrate(a):
    """Backward trace and allreduce fit; rank 0 writes them to ``a.calib``."""
    import torch
    from horovod_sparse.schedule.cost import CostModel
    from horovod_sparse.whatif.profile import measure_backward
    torch.set_num_threads(1)
    r = Ranks()
    torch.manual_seed(0)
    model, loss_fn, make_batch = build_model(a.delay_scale)
    x, y = make_batch(1 + r.rank)
    r.comm.Barrier()   # both ranks compute at once, as in training
    grads, _, timings = measure_backward(model, x, y, loss_fn, "cpu", steps=max(3, a.steps // 2), warmup=2)
    names = [g.name for g in grads]
    if len(set(map(tuple, r.comm.allgather(names)))) != 1:
        raise RuntimeError("the ranks saw different backward orders")
    waits = r.max([g.wait_s for g in grads])
    keys = sorted(timings)
    timings = dict(zip(keys, r.max([timings[k] for k in keys])))
    sizes = [int(g.nbytes) for g in grads]
    points = []
    for m in fit_sizes(sum(sizes)):
        t = torch.ones(m // 4)
        # A train of back-to-back allreduces per timing, not one alone: tc's token bucket
        # (burst 256 kb) lets an isolated small message out at wire speed, which made the
        # line's intercept negative on 1gbit; in a step the link is busy, so the steady
        # cost per allreduce is what the planner needs. The burst is amortised over the train.
        train = train_length(m)
        times = []
        for i in range(a.fit_repeats + 1):
            r.comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(train):
                r.hvd.allreduce(t, name=f"fit.{m}")
            times.append((time.perf_counter() - t0) / train)
        points.append([m, statistics.median(r.max(times[1:]))])
    line, r2 = CostModel.fit([p[0] for p in points], [p[1] for p in points])
    r.say(f"[schedule] {a.link}: backward {sum(waits) * 1e3:.1f} ms over {len(names)} gradients "
          f"({sum(sizes) / 1e6:.1f} MB); allreduce fit a = {line.a * 1e3:.3f} ms, "
          f"b = {line.b * 1e9:.3f} ns/B ({8 / line.b / 1e9 if line.b > 0 else float('inf'):.2f} Gbit/s "
          f"effective), R^2 = {r2:.4f}")
    if r.rank == 0:
        out = {"link": a.link, "np": r.size, "names": names, "compute_s": waits, "sizes": sizes,
               **timings, "fit": {"a": line.a, "b": line.b, "r2": r2, "points": points},
               "delay_scale": a.delay_scale, "model": model_desc()}
        os.makedirs(os.path.dirname(os.path.abspath(a.calib)), exist_ok=True)
        with open(a.calib, "w") as f:
            json.dump(out, f)
    r.comm.Barrier()
    return 0


def plan_for(schedule, calib, cost_kind="line"):
    """(plan or None for Horovod's default, cost) from the calibration, the same on every
    rank. ``cost_kind`` "line": the fitted a + b*M; "table": the fit points interpolated
    (the line's intercept can come out negative on a token-bucket link, and a planner
    that believes start-ups are negative never merges)."""
    from horovod_sparse.schedule.cost import CostModel, TableCost
    from horovod_sparse.schedule.planner import make_plan
    if cost_kind == "table":
        cost = TableCost(*zip(*calib["fit"]["points"]))
    else:
        cost = CostModel(calib["fit"]["a"], calib["fit"]["b"])
    if schedule == "default":
        return None, cost
    return make_plan(schedule, calib["compute_s"], calib["sizes"], cost, channels=1), cost


def predict(schedule, plan, cost, calib):
    """Predicted step seconds (the step without communication plus the simulated
    communication not hidden behind backward) and the simulated buckets."""
    from horovod_sparse.schedule.simulate import ready_times, simulate, simulate_cycles
    ready = ready_times(calib["compute_s"])
    bk_end = ready[-1] + calib["tail_s"]
    if plan is None:
        sim = simulate_cycles(ready, calib["sizes"], cost, HOROVOD_CYCLE_S, HOROVOD_FUSION_BYTES, backward_end=bk_end)
    else:
        sim = simulate(ready, calib["sizes"], plan, cost, channels=1, backward_end=bk_end)
    return calib["batch_time_s"] + sim.overhead, sim


def run_schedule(a):
    """One schedule: its env before hvd.init(), warm-up + timed steps, a record (rank 0)."""
    with open(a.calib) as f:
        calib = json.load(f)
    import torch
    from horovod_sparse.schedule.cost import TableCost
    from horovod_sparse.schedule.groups import horovod_groups
    torch.set_num_threads(1)
    ours = a.compressor is not None and a.schedule != "default"
    plan, cost = plan_for("default" if ours else a.schedule, calib, a.cost)   # ours plans itself
    torch.manual_seed(0)
    model, loss_fn, make_batch = build_model(a.delay_scale)
    params = dict(model.named_parameters())
    groups, env = None, {}
    if plan is not None and not ours:
        groups, env = horovod_groups(plan, [params[n] for n in calib["names"]], calib["sizes"])
        os.environ.update(env)   # read by hvd.init(), which comes next
    r = Ranks()
    hvd = r.hvd
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x, y = make_batch(1 + r.rank)
    compression = hvd.Compression.none
    warmup = a.warmup
    if ours:
        import horovod_sparse.torch as hvds
        from horovod_sparse.schedule.planner import PLANNED
        from horovod_sparse.step.trials import WARMUP_STEPS
        trials = {"trial_steps": TRIAL_STEPS} if a.schedule == "auto" else {}
        compression = hvds.Compression.from_spec(a.compressor, schedule=a.schedule, profile_steps=PROFILE_STEPS,
                                                 **trials)
        # profiled steps, the planning step, auto's candidates (at most one per planned schedule), one planned
        warmup = max(a.warmup, PROFILE_STEPS + 2 + ((WARMUP_STEPS + TRIAL_STEPS) * len(PLANNED) if trials else 0))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters(),
                                   compression=compression, groups=groups)
    times = []
    for i in range(warmup + a.steps):
        r.comm.Barrier()   # every step starts together; not timed
        t0 = time.perf_counter()
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i >= warmup:
            times.append((t1 - t0, t2 - t0))
    times = [r.max(t) for t in times]
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy()
    digests = r.comm.allgather(hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest())
    report = getattr(compression, "schedule_report", None)
    timeline = compression.last_step_timeline() if ours else None   # the last timed step, this rank
    if ours:
        compression.close()
    predicted_s, sim = predict(a.schedule if not ours else "default", plan, cost, calib)
    if ours:   # the compressor's own model: its fitted exchange, the simulated end of its plan
        # (after_backward and wfbp plan without a fit: filled from "auto"'s by the report)
        fitted = report is not None and report.get("fit_a_s") is not None and "predicted_s" in report
        predicted_s = (calib["batch_time_s"] + report["predicted_s"][report["chosen"]] - report["backward_s"]
                       if fitted else None)
    # The same plan priced by the measured points themselves (interpolated), to tell the
    # line's error from the simulator's.
    table = TableCost(*zip(*calib["fit"]["points"]))
    table_s, _ = predict(a.schedule, plan, table, calib) if not ours else (None, None)
    measured = statistics.median(t for _, t in times)
    rec = {
        "bench": "schedule", "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "link": a.link, "link_bps": link_bps(a.link), "np": r.size, "schedule": a.schedule,
        "compressor": a.compressor if ours else "horovod-none",
        "schedule_report": _jsonable(report) if r.rank == 0 else None, "timeline": timeline,
        "plan": ([list(b) for b in (plan if plan is not None else sim.plan)] if not ours
                 else [[len(k), c] for k, c in zip(report["buckets"], report["channels"])] if report else None),
        "buckets": len(sim.plan) if not ours else (len(report["buckets"]) if report else 1),
        "measured_ms": measured * 1e3, "measured_min_ms": min(t for _, t in times) * 1e3,
        "measured_max_ms": max(t for _, t in times) * 1e3,
        "fwd_bwd_ms": statistics.median(fb for fb, _ in times) * 1e3,
        "predicted_ms": _ms(predicted_s), "error_pct": _error(predicted_s, measured),
        "predicted_overhead_ms": sim.overhead * 1e3 if not ours else None, "predicted_table_ms": _ms(table_s),
        "error_table_pct": _error(table_s, measured), "batch_ms": calib["batch_time_s"] * 1e3,
        "backward_ms": (sum(calib["compute_s"]) + calib["tail_s"]) * 1e3,
        "cost_model": a.cost, "fit_a": calib["fit"]["a"], "fit_b": calib["fit"]["b"],
        "r2": calib["fit"]["r2"], "fit_points": calib["fit"]["points"],
        "gradients": len(calib["sizes"]), "grad_bytes": sum(calib["sizes"]),
        "env": {**env, **{k: os.environ[k] for k in HOROVOD_KNOBS if k in os.environ}},
        "replicas_identical": len(set(digests)) == 1, "steps": a.steps, "warmup": warmup,
        "delay_scale": a.delay_scale, "model": calib["model"], "torch": torch.__version__,
        "horovod": __import__("horovod").__version__,
        "command": shlex.join(["python", "scripts/bench_schedule.py"] + sys.argv[1:]),
        "driver_command": os.environ.get(DRIVER_ENV),
    }
    r.say(f"[schedule] {a.link} {rec['compressor']} {a.schedule:>14}: {rec['buckets']:2d} buckets, measured "
          f"{measured * 1e3:7.1f} ms, predicted {_text(rec['predicted_ms'])} ms ({_pct(rec['error_pct'])}; "
          f"measured-table cost {_pct(rec['error_table_pct'])}), replicas "
          f"{'identical' if rec['replicas_identical'] else 'DIFFER'}")
    if r.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    r.comm.Barrier()
    return 0


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _error(predicted_s, measured_s):
    return None if predicted_s is None else (predicted_s - measured_s) / measured_s * 100


def _text(ms):
    return "n/a" if ms is None else f"{ms:7.1f}"


def _jsonable(report):
    """The compressor's schedule report with its keys and numbers as JSON takes them."""
    return None if report is None else json.loads(json.dumps(report, default=float))


# ---------------------------------------------------------------------- driver side
def worker_command(a, link, *extra):
    """The netem.py command line of one job on ``link``."""
    rate = "none" if link == "loopback" else link
    bench = [a.python, os.path.join("scripts", "bench_schedule.py"), "--link", link,
             "--steps", str(a.steps), "--warmup", str(a.warmup), "--delay-scale", str(a.delay_scale),
             "--fit-repeats", str(a.fit_repeats), "--cost", a.cost, "--out", a.out, *extra]
    if a.compressor:
        bench += ["--compressor", a.compressor]
    # "--mpirun-args=...": with a space argparse would read the value, which starts with "--",
    # as an option.
    return [a.python, os.path.join("scripts", "netem.py"), "--rate", rate, "-np", str(a.np),
            f"--mpirun-args={MPIRUN_ARGS}", "--"] + bench


def drive(a, argv):
    cmdline = shlex.join(["python", "scripts/bench_schedule.py"] + (sys.argv[1:] if argv is None else argv))
    env = {k: v for k, v in os.environ.items() if k not in HOROVOD_KNOBS}
    env.update(RANK_ENV)
    env[DRIVER_ENV] = cmdline
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    open(a.out, "w").close()
    failed, start = [], time.monotonic()
    for link in a.links:
        calib = os.path.splitext(a.out)[0] + f".calib-{link}.json"
        jobs = [("calibrate", worker_command(a, link, "--worker", "calibrate", "--calib", calib))]
        jobs += [(s, worker_command(a, link, "--worker", "run", "--schedule", s, "--calib", calib))
                 for s in a.schedules]
        for what, job in jobs:
            print(f"[schedule] === {link} {what} ({time.monotonic() - start:.0f} s so far): {shlex.join(job)}",
                  flush=True)
            job_env = env
            if a.compressor and a.cycle_ms is not None and what not in ("calibrate", "default"):
                job_env = {**env, "HOROVOD_CYCLE_TIME": f"{a.cycle_ms:g}"}
            rc, _ = run_job(job, job_env, a.timeout)
            if rc != 0:
                print(f"[schedule] !!! {link} {what} failed (exit {rc})", flush=True)
                failed.append(f"{link}:{what}")
                if what == "calibrate":
                    break   # no trace, no plans
    print(f"[schedule] done in {time.monotonic() - start:.0f} s" + (f"; failed: {' '.join(failed)}" if failed else ""),
          flush=True)
    if not a.no_doc and os.path.getsize(a.out):
        os.makedirs(os.path.dirname(os.path.abspath(a.data)), exist_ok=True)
        shutil.copyfile(a.out, a.data)
        report(a)
    return 1 if failed else 0


# ------------------------------------------------------------------------ the report
def load(path):
    """Records of ``path``; a later record of the same (link, schedule) wins."""
    recs = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                recs[(r["link"], r.get("compressor"), r["schedule"])] = r
    return list(recs.values())


def _plan_text(plan):
    if len(plan) > 6:
        return f"{len(plan)} buckets"
    return " ".join(f"[{b[0]},{b[1]})" for b in plan)


def _pct(v):
    return "" if v is None else f"{v:+.1f}%"


def markdown(recs, png):
    links = list(dict.fromkeys(r["link"] for r in recs))
    out = [f"Model: {recs[0]['model']}; {recs[0]['gradients']} gradients, "
           f"{recs[0]['grad_bytes'] / 1e6:.1f} MB; P = {recs[0]['np']}; Horovod {recs[0]['horovod']}, "
           f"torch {recs[0]['torch']}; {recs[0]['warmup']} warm-up + {recs[0]['steps']} timed steps per "
           "schedule, each in a fresh job. Step = median over steps of the max over ranks of "
           "zero_grad + forward + backward + `opt.step()`. Predicted = the step without "
           "communication (calibration) + the simulated communication not hidden behind backward, "
           "with the fitted line as the cost (the planners' input); \"error, table cost\" prices the "
           "same plan with the measured fit points, interpolated (`TableCost`).", "",
           f"Driver command: `{recs[0].get('driver_command') or 'n/a'}`", "",
           "| link | a (ms) | b (ns/B) | effective Gbit/s | R^2 | backward (ms) | step without comm (ms) |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for link in links:
        r = next(x for x in recs if x["link"] == link)
        out.append(f"| {link} | {r['fit_a'] * 1e3:.3f} | {r['fit_b'] * 1e9:.3f} | "
                   f"{8 / r['fit_b'] / 1e9 if r['fit_b'] > 0 else float('inf'):.2f} | {r['r2']:.4f} | "
                   f"{r['backward_ms']:.1f} | {r['batch_ms']:.1f} |")
    out += ["", "Fit points (allreduce of M bytes, measured ms / line ms):", ""]
    for link in links:
        r = next(x for x in recs if x["link"] == link)
        out.append(f"- {link}: " + ", ".join(
            f"{m / 2 ** 20:.3g} MiB {t * 1e3:.2f}/{(r['fit_a'] + r['fit_b'] * m) * 1e3:.2f}"
            for m, t in r["fit_points"]))
    out += ["", "| link | schedule | plan | predicted (ms) | measured (ms) | error | error, table cost | "
            "vs default | vs wfbp | replicas |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---|"]
    for link in links:
        rows = sorted((x for x in recs if x["link"] == link), key=lambda x: SCHEDULES.index(x["schedule"]))
        ref = {x["schedule"]: x["measured_ms"] for x in rows}
        # default's "plan" is what the simulated fusion cycles formed, not something run
        for r in rows:
            vs = lambda k: f"{ref[k] / r['measured_ms']:.2f}x" if k in ref else ""  # noqa: E731
            plan = ("simulated: " if r["schedule"] == "default" else "") + _plan_text(r["plan"])
            out.append(f"| {link} | {r['schedule']} | {plan} | {r['predicted_ms']:.1f} | "
                       f"{r['measured_ms']:.1f} | {r['error_pct']:+.1f}% | {_pct(r.get('error_table_pct'))} | "
                       f"{vs('default')} | {vs('wfbp')} | "
                       f"{'identical' if r['replicas_identical'] else 'DIFFER'} |")
    out += ["", "Against the targets, computed from these records:", ""]
    worst = max(recs, key=lambda x: abs(x["error_pct"]))
    out.append(f"- predicted within 15% of measured for every schedule: "
               f"{'yes' if abs(worst['error_pct']) <= 15 else 'no'} (worst: {worst['link']} "
               f"{worst['schedule']}, {worst['error_pct']:+.1f}%)")
    for link in links:
        ref = {x["schedule"]: x["measured_ms"] for x in recs if x["link"] == link}
        if "optimal" in ref and "wfbp" in ref:
            s = ref["wfbp"] / ref["optimal"]
            target = (f" (target >= 1.15x at 1 Gbit/s: {'met' if s >= 1.15 else 'not met'})"
                      if link_bps(link) == 1e9 else "")
            out.append(f"- {link}: `optimal` vs `wfbp` {s:.2f}x{target}")
        planned = {k: v for k, v in ref.items() if k != "default"}
        if "default" in ref and planned:
            best = min(planned, key=planned.get)
            out.append(f"- {link}: best plan `{best}` {planned[best]:.1f} ms vs Horovod's default "
                       f"{ref['default']:.1f} ms ({'no slower' if planned[best] <= ref['default'] else 'slower'})")
    out += ["", f"![predicted vs measured step time per schedule and link]({png})"]
    return "\n".join(out)


def plot(recs, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = list(dict.fromkeys(r["link"] for r in recs))
    fig, axes = plt.subplots(1, len(links), figsize=(5.5 * len(links), 4), squeeze=False)
    for ax, link in zip(axes[0], links):
        rows = sorted((x for x in recs if x["link"] == link), key=lambda x: SCHEDULES.index(x["schedule"]))
        xs = range(len(rows))
        ax.bar([i - 0.2 for i in xs], [r["measured_ms"] for r in rows], 0.4,
               label="measured (median; bars: min-max of steps)",
               yerr=[[r["measured_ms"] - r["measured_min_ms"] for r in rows],
                     [r["measured_max_ms"] - r["measured_ms"] for r in rows]], capsize=3)
        ax.bar([i + 0.2 for i in xs], [r["predicted_ms"] for r in rows], 0.4, label="predicted")
        ax.set_xticks(list(xs), [r["schedule"] for r in rows], rotation=20)
        ax.set_ylabel("step time (ms)")
        ax.set_title(f"dense, P = {rows[0]['np']}, {link}")
        top = max(max(r["measured_max_ms"], r["predicted_ms"]) for r in rows)
        ax.set_ylim(0, top * 1.3)   # room for the legend above the bars
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def filled_predictions(recs):
    """Our compressor's after_backward and wfbp runs plan without a cost fit: their
    prediction is what the "auto" run of the same link predicted for them, from its fit."""
    for r in recs:
        if r["predicted_ms"] is not None or r.get("compressor") in (None, "horovod-none"):
            continue
        auto = next((x for x in recs if x["link"] == r["link"] and x["schedule"] == "auto"
                     and x.get("schedule_report")), None)
        if auto is not None and r["schedule"] in auto["schedule_report"]["predicted_s"]:
            rep = auto["schedule_report"]
            predicted = r["batch_ms"] + (rep["predicted_s"][r["schedule"]] - rep["backward_s"]) * 1e3
            r.update(predicted_ms=predicted, error_pct=(predicted - r["measured_ms"]) / r["measured_ms"] * 100,
                     predicted_from="auto")
    return recs


def markdown_compressor(recs):
    """The tables of a --compressor run: each schedule of the compressor beside Horovod's own
    dense fusion, predicted by the compressor's own fit beside measured, and the targets."""
    spec = next(r["compressor"] for r in recs if r["compressor"] != "horovod-none")
    links = list(dict.fromkeys(r["link"] for r in recs))
    first = recs[0]
    out = [f"Compressor `{spec}` with each `schedule=`, beside Horovod's own dense fusion (`default`). "
           f"Model: {first['model']}; {first['gradients']} gradients, {first['grad_bytes'] / 1e6:.1f} MB; "
           f"P = {first['np']}; warm-up steps (the compressor's {PROFILE_STEPS} profiled "
           f"steps, its planning step and `auto`'s 1 + {TRIAL_STEPS} steps per candidate plan among them: "
           f"{', '.join(sorted({str(r['warmup']) for r in recs}))}) + {first['steps']} timed steps, "
           "each schedule in a fresh "
           "job. Step = median over steps of the max over ranks. Predicted = the step without "
           "communication (calibration) + the simulated end of the plan beyond backward, from the "
           "compressor's own fit of its exchange (a + b*M on its channel, k2 on two) and its measured "
           "arrivals; `after_backward` and `wfbp` plan without a fit, so their prediction is the `auto` "
           "run's for them. Horovod's cycle time in the compressor's runs: "
           f"{next((r['env'].get('HOROVOD_CYCLE_TIME') for r in recs if r['compressor'] != 'horovod-none'), None) or '1'}"
           " ms (`default`: Horovod's defaults).", "", f"Driver command: `{first.get('driver_command') or 'n/a'}`", "",
           "| link | fit a (ms) | fit b (ns/B) | R^2 | k2 | measured backward (ms) |", "|---|---:|---:|---:|---:|---:|"]
    for link in links:
        rep = next((x["schedule_report"] for x in recs if x["link"] == link and x["schedule"] == "auto"
                    and x.get("schedule_report")), None)
        if rep and rep.get("fit_b_s_per_byte") is not None:
            k2 = rep.get("simultaneity")
            out.append(f"| {link} | {rep['fit_a_s'] * 1e3:.3f} | {rep['fit_b_s_per_byte'] * 1e9:.3f} | "
                       f"{rep['fit_r2']:.3f} | {'n/a' if k2 is None else f'{k2:.2f}'} | {rep['backward_s'] * 1e3:.1f} |")
    out += ["", "| link | schedule | ran as | buckets (channels) | predicted (ms) | measured (ms) | error | "
                "vs after_backward | vs Horovod default | replicas |", "|---|---|---|---|---:|---:|---:|---:|---:|---|"]
    for link in links:
        rows = sorted((x for x in recs if x["link"] == link), key=lambda x: COMPRESSOR_SCHEDULES.index(x["schedule"]))
        ref = {x["schedule"]: x["measured_ms"] for x in rows}
        for r in rows:
            rep = r.get("schedule_report") or {}
            ran = "Horovod dense" if r["compressor"] == "horovod-none" else rep.get("chosen", r["schedule"])
            chans = sorted({c for _, c in r["plan"]}) if r["compressor"] != "horovod-none" and r["plan"] else [0]
            vs = lambda k: f"{ref[k] / r['measured_ms']:.2f}x" if k in ref else ""  # noqa: E731
            out.append(f"| {link} | {r['schedule']} | {ran} | {r['buckets']} ({len(chans)}) | "
                       f"{_text(r['predicted_ms']).strip()} | {r['measured_ms']:.1f} | {_pct(r['error_pct'])} | "
                       f"{vs('after_backward')} | {vs('default')} | "
                       f"{'identical' if r['replicas_identical'] else 'DIFFER'} |")
    out += ["", "Against the targets, from these records:", ""]
    errors = [r for r in recs if r["error_pct"] is not None and r["compressor"] != "horovod-none"]
    if errors:
        worst = max(errors, key=lambda x: abs(x["error_pct"]))
        within = sum(abs(r["error_pct"]) <= 15 for r in errors)
        out.append(f"- predicted within 15% of measured: {within} of {len(errors)} "
                   f"(worst: {worst['link']} {worst['schedule']}, {worst['error_pct']:+.1f}%)")
    for link in links:
        ref = {x["schedule"]: x["measured_ms"] for x in recs if x["link"] == link and x["compressor"] != "horovod-none"}
        if "after_backward" in ref and len(ref) > 1:
            best = min((k for k in ref if k != "after_backward"), key=ref.get)
            out.append(f"- {link}: best schedule `{best}` {ref[best]:.1f} ms, "
                       f"{ref['after_backward'] / ref[best]:.2f}x faster than `after_backward` "
                       f"({ref['after_backward']:.1f} ms)")
        if "optimal" in ref and "wfbp" in ref:
            out.append(f"- {link}: `optimal` vs `wfbp` {ref['wfbp'] / ref['optimal']:.2f}x")
        auto = next((x["schedule_report"] for x in recs if x["link"] == link and x["schedule"] == "auto"
                     and (x.get("schedule_report") or {}).get("trials")), None)
        if auto is not None:
            tried = ", ".join(f"`{t['schedule']}` {t['measured_s'] * 1e3:.1f}" for t in auto["trials"])
            out.append(f"- {link}: `auto` tried (median step period of {TRIAL_STEPS} timed steps, slowest rank, "
                       f"ms): {tried}; kept `{auto['chosen']}`")
        default = next((x["measured_ms"] for x in recs if x["link"] == link and x["schedule"] == "default"), None)
        if default is not None and "auto" in ref:
            out.append(f"- {link}: `auto` {ref['auto']:.1f} ms vs Horovod's default fusion {default:.1f} ms "
                       f"({'no slower' if ref['auto'] <= default else 'slower'}: {default / ref['auto']:.2f}x)")
    return "\n".join(out)


def plot_timelines(recs, png):
    """One step of each of the compressor's planned schedules (rank 0, the last timed step):
    gradients arriving (backward), each bucket from ready to the end of its exchange, a lane
    per channel."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    links = list(dict.fromkeys(r["link"] for r in recs))
    rows = sorted((r for r in recs if r.get("timeline")),
                  key=lambda x: (links.index(x["link"]), COMPRESSOR_SCHEDULES.index(x["schedule"])))
    if not rows:
        return False
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.3 + 1.0 * len(rows)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        t = r["timeline"]
        ax.plot([x * 1e3 for x in t["arrived"]], [-0.6] * len(t["arrived"]), "k|", markersize=8)
        for b in t["buckets"]:   # waits first, so that no wait hides an earlier exchange on its lane
            ax.barh(b["channel"], (b["start"] - b["ready"]) * 1e3, left=b["ready"] * 1e3, height=0.5, color="0.85")
        for b in t["buckets"]:
            ax.barh(b["channel"], (b["end"] - b["start"]) * 1e3, left=b["start"] * 1e3, height=0.5,
                    color=f"C{b['bucket'] % 10}", edgecolor="k", linewidth=0.4)
        ax.axvline(t["finish"] * 1e3, color="k", linestyle=":", linewidth=1)
        channels = sorted({b["channel"] for b in t["buckets"]})
        ax.set_yticks([-0.6] + channels, ["backward"] + [f"channel {c}" for c in channels], fontsize=7)
        ax.set_ylim(-1.1, max(channels) + 0.5)
        rep = r.get("schedule_report") or {}
        ax.set_title(f"{r['link']}, {r['schedule']} (ran as {rep.get('chosen', r['schedule'])}): step {r['measured_ms']:.0f} ms "
                     "median", fontsize=8, loc="left")
    axes[-1, 0].set_xlabel("ms after the first gradient arrived (ticks: gradients at compress; grey: waiting "
                           "for the channel; colour: exchange; dotted: first decompress)", fontsize=7)
    links = ", ".join(dict.fromkeys(r["link"] for r in rows))
    fig.suptitle(f"{rows[0]['compressor']}, P = {rows[0]['np']}, {links}: one step per schedule", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True


def report(a):
    if not os.path.exists(a.data):
        print(f"[schedule] no records in {a.data}", flush=True)
        return 1
    recs = load(a.data)
    spec = next((r.get("compressor") for r in recs if r.get("compressor") not in (None, "horovod-none")), None)
    if spec is not None:
        block = "schedule-" + spec.split(":")[0]
        text = markdown_compressor(filled_predictions(recs))
        png = os.path.join(os.path.dirname(a.data), f"timeline-{spec.split(':')[0]}.png")
        if plot_timelines(recs, png):
            text += (f"\n\n![one step of each schedule: backward and the exchanges per channel]"
                     f"({os.path.relpath(png, os.path.dirname(os.path.abspath(a.md)))})")
        replace_block(a.md, block, text)
        print(f"[schedule] {len(recs)} records from {a.data} -> {a.md} (block {block})", flush=True)
        return 0
    plot(recs, a.png)
    png = os.path.relpath(a.png, os.path.dirname(os.path.abspath(a.md)))
    replace_block(a.md, "schedule", markdown(recs, png))
    print(f"[schedule] {len(recs)} records from {a.data} -> {a.md}, {a.png}", flush=True)
    return 0


def main(argv=None):
    a = parse_args(argv)
    if a.worker == "calibrate":
        return calibrate(a)
    if a.worker == "run":
        return run_schedule(a)
    os.chdir(REPO)
    if a.report:
        return report(a)
    return drive(a, argv)


if __name__ == "__main__":
    sys.exit(main())
