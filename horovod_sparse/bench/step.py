"""End-to-end training step, every compressor side by side with dense, through the stock
``hvd.DistributedOptimizer`` (PyTorch) or ``hvd.DistributedGradientTape`` (TensorFlow,
``--framework tensorflow``, :mod:`horovod_sparse.bench.step_tf`). Run it under MPI, one
process per rank:

    mpirun -np 2 python -m horovod_sparse.bench.step --models mlp5 mlp30 --out results/step.jsonl
    mpirun -np 2 python -m horovod_sparse.bench.step --framework tensorflow --out results/step-tf.jsonl
    python scripts/netem.py --rate 1gbit -np 2 -- python -m horovod_sparse.bench.step --link 1gbit

(``scripts/bench_step.py`` does the second for every link and writes docs/results/performance.md.)

Per model, round and compressor: a fresh model (same seed on every rank, then
``hvd.broadcast_parameters``), a fresh plain SGD and a fresh compressor; ``--warmup``
untimed steps, then ``--steps`` timed steps, each as ``Barrier(); forward + backward;
opt.step()``, timed with ``time.perf_counter``. Each step's times are the maximum over
ranks; the record holds medians over all timed steps of all rounds. ``--rounds R``
repeats the whole compressor list R times, interleaved, so that a slow spell of a shared
machine hits every compressor alike. After the last step the ranks compare a hash of
their parameters (``replicas_identical``).

Also measured in the same run, per model: one copy of a float32 buffer as large as the
model (``copy_ms``, the memory bound of any pass over the gradient), and the bytes a ring
allreduce sends per rank per step (``dense_bytes`` = 2 n (P-1)/P * 4) over the link rate
(``link_ms``, the link bound of dense; null on loopback).

Rank 0 prints one line per run and appends one JSON object per (model, compressor) to
``--out``. An error in one compressor is recorded and the next one runs; if the ranks
disagree about an error (a collective may be left half done) or a run exceeds
``--timeout``, the job writes what it has and stops.

The models are the MLPs of :mod:`horovod_sparse.models` (random data, MSE) and the real
workloads of :mod:`horovod_sparse.workloads` (``digits_resnet``: torchvision's ResNet-18;
``stdlib_lm``: a byte-level transformer), each with its own loss on the first batch of the
rank's shard (PyTorch only). Importing this module imports only
the standard library: torch, Horovod, numpy and mpi4py are imported by :func:`run`, so the
argument parsing can be used (and tested) without them.

This module is the driver both frameworks share (arguments, records, summaries, the
watchdog, the warm-up / settling / timed loop, maxima over ranks, the parameter hash):
:class:`StepBench`. What differs per framework (Horovod's module, the model and its step,
the copy of the memory bound, the versions recorded) is a subclass: :class:`Bench`
(PyTorch) and :class:`TFBench` (TensorFlow, whose pieces are
:class:`horovod_sparse.bench.step_tf.TFRunner`'s). Every record names its ``framework``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import hashlib
import json
import os
import platform
import re
import shlex
import socket
import statistics
import sys
import threading
import time

from horovod_sparse.models import MODELS, build_model  # stdlib only at import, like this module
from horovod_sparse.workloads import NAMES as WORKLOADS  # likewise
from horovod_sparse.workloads import parse_size
from horovod_sparse.workloads.recipes import recipe_spec
from horovod_sparse.workloads.recipes import recipe_for

RATE_ENV = "HSP_NETEM_RATE"            # set by scripts/netem.py
DRIVER_ENV = "HSP_BENCH_DRIVER_COMMAND"  # set by scripts/bench_step.py, recorded as is

#: Horovod's own compressors, by the names this benchmark gives them.
HOROVOD_COMPRESSORS = {"dense": "none", "hvd-none": "none", "hvd-fp16": "fp16"}
#: most warm-up steps given to Compression.auto to settle before the timed ones
MAX_SETTLING_STEPS = 200
#: What ``--framework`` takes; a record without a ``framework`` field is PyTorch's (older records).
FRAMEWORKS = ("torch", "tensorflow")

#: Every compressor, at density 0.01 for the sparsifiers. threshold: 1.5e-5 keeps about 1% of
#: mlp5's first gradient with this data (|g| quantiles: 50% 1.8e-6, 99% 1.6e-5, 99.9% 2.6e-5).
DEFAULT_COMPRESSORS = (
    "dense", "hvd-fp16",
    "topk:density=0.01", "oktopk:density=0.01", "gtopk:density=0.01",
    "gaussiank:density=0.01", "dgc:density=0.01", "randomk:density=0.01", "threshold:value=1.5e-5",
    "bf16", "qsgd", "int4", "terngrad", "signsgd", "signum", "efsignsgd", "onebit", "powersgd", "fft",
)

#: What ``--models`` takes: the synthetic models (random data, MSE) and the real workloads
#: (their own model, loss and first batch of this rank's shard).
MODEL_CHOICES = sorted(MODELS) + list(WORKLOADS)

#: plain SGD's learning rate when no ``--recipe`` is given (the step's time does not depend on it)
PLAIN_SGD_LR = 1e-3

_TC_RATE = re.compile(r"^(\d+(?:\.\d+)?)([kmgt]?)(i?)(bit|bps)$")
_POWER = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


# --------------------------------------------------------------------------- arguments
def link_bps(link: str) -> float | None:
    """Bits per second of a ``tc`` rate (``1gbit``, ``100mbit``, ``10gibit``, ``125mbps``);
    None for loopback. ``bit`` units are bits/s, ``bps`` bytes/s, as in tc."""
    text = link.strip().lower()
    if text in ("loopback", "none", "lo", "unknown"):
        return None
    m = _TC_RATE.match(text)
    if not m:
        raise ValueError(f"bad link rate {link!r}: use a tc rate such as 1gbit, 10gbit, or loopback")
    base = 1024 if m.group(3) else 1000
    return float(m.group(1)) * base ** _POWER[m.group(2)] * (8 if m.group(4) == "bps" else 1)


def _link(text: str) -> str:
    try:
        link_bps(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    t = text.strip().lower()
    return "loopback" if t in ("none", "lo") else t


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _non_negative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m horovod_sparse.bench.step",
        description="Time the training step through hvd.DistributedOptimizer for each compressor "
                    "(run under mpirun; rank 0 prints and writes JSON lines).")
    p.add_argument("--framework", choices=FRAMEWORKS, default="torch",
                   help="torch: hvd.DistributedOptimizer; tensorflow: hvd.DistributedGradientTape in "
                        "a tf.function (the models of horovod_sparse.models only) (default torch)")
    p.add_argument("--tf-groups", type=_non_negative, default=0, metavar="N",
                   help="TensorFlow only: DistributedGradientTape(groups=N) for every compressor, "
                        "Horovod's dense included; 0: Horovod's default, one allreduce request per "
                        "gradient (default 0)")
    p.add_argument("--tf-api", choices=("tape", "keras"), default="tape",
                   help="TensorFlow only: tape: hvd.DistributedGradientTape in a tf.function; keras: "
                        "model.train_on_batch with horovod.tensorflow.keras.DistributedOptimizer "
                        "(default tape)")
    p.add_argument("--models", nargs="+", default=["mlp5", "mlp30"], choices=MODEL_CHOICES,
                   help="models to run, in order: the MLPs of horovod_sparse.models or a real "
                        "workload of horovod_sparse.workloads (PyTorch only) (default: mlp5 mlp30)")
    p.add_argument("--compressors", nargs="+", default=list(DEFAULT_COMPRESSORS), metavar="SPEC",
                   help="'dense' (Horovod's Compression.none), 'hvd-fp16' (Horovod's fp16), or a "
                        "horovod_sparse spec such as oktopk:density=0.01 (default: all, see --list)")
    p.add_argument("--steps", type=_positive, default=10, help="timed steps per round (default 10)")
    p.add_argument("--warmup", type=_non_negative, default=3, help="untimed steps first (default 3)")
    p.add_argument("--rounds", type=_positive, default=1,
                   help="repeat the compressor list this many times, interleaved; medians over "
                        "all timed steps (default 1)")
    p.add_argument("--lr", type=float, default=None,
                   help=f"learning rate (default: plain SGD's {PLAIN_SGD_LR}, or the --recipe's own)")
    p.add_argument("--recipe", default=None, type=recipe_spec,
                   help="PyTorch only: the optimizer of a training recipe (horovod_sparse.workloads.recipes, "
                        "at the model's own rate, without its schedule), so that the step times the update "
                        "users run and auto's quality guard sees their optimizer (default: plain SGD)")
    p.add_argument("--model", type=parse_size, default={}, metavar="KEY=INT,...",
                   help="the language model's size (stdlib_lm only), e.g. layers=4,d_model=256,heads=4, "
                        "as bench_tta's --model (default: its own)")
    p.add_argument("--seed", type=int, default=0, help="model seed (data: seed + 1000 * (rank + 1))")
    p.add_argument("--link", type=_link, default=None,
                   help=f"the link's tc rate, for the record and the link bound (default: ${RATE_ENV} "
                        "set by scripts/netem.py, else loopback)")
    p.add_argument("--copy-repeats", type=_positive, default=10,
                   help="timed copies for the memory bound (default 10)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one compressor run (warm-up + timed steps) may take before the "
                        "job writes what it has and aborts (default 900)")
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    p.add_argument("--note", default="", help="free text stored in every record (e.g. 'harness check')")
    p.add_argument("--list", action="store_true", help="print the default compressor list and exit")
    return p


def check_framework_args(args, error):
    """Call ``error(message)`` (argparse's ``parser.error``) where the options do not fit
    ``args.framework``: the real workloads and ``--tf-groups`` belong to one framework each.
    Shared by this module's parser and scripts/bench_step.py's."""
    if args.framework == "tensorflow":
        torch_only = [m for m in args.models if m not in MODELS]
        if torch_only:
            error(f"--framework tensorflow runs the models {sorted(MODELS)}, not {' '.join(torch_only)} "
                  "(PyTorch workloads)")
        if args.recipe:
            error("--recipe is for --framework torch")
    elif args.tf_groups or args.tf_api != "tape":
        error("--tf-groups and --tf-api are for --framework tensorflow")
    if args.model and args.models != ["stdlib_lm"]:
        error(f"--model sizes the language model: use it with --models stdlib_lm alone, not {' '.join(args.models)}")


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    check_framework_args(args, parser.error)
    if args.link is None:
        args.link = _link(os.environ.get(RATE_ENV, "loopback"))
    if args.lr is None and args.recipe is None:
        args.lr = PLAIN_SGD_LR
    return args


def is_horovod_spec(spec: str) -> bool:
    return spec in HOROVOD_COMPRESSORS


# ------------------------------------------------------------------------- statistics
def median_or_none(values):
    return statistics.median(values) if values else None


def dense_bytes(n_params: int, world_size: int, itemsize: int = 4) -> float:
    """Bytes a rank sends in a ring allreduce of n_params values: 2 n (P-1)/P * itemsize."""
    return 0.0 if world_size <= 1 else 2.0 * n_params * (world_size - 1) / world_size * itemsize


def link_ms(nbytes: float, link: str) -> float | None:
    bps = link_bps(link)
    return None if bps is None else nbytes * 8 / bps * 1e3


def summarize(times, error=None):
    """Medians (ms) of the per-step maxima over ranks. ``times``: one tuple per step, either
    (fwd_bwd_s, step_s), PyTorch's two parts whose sum is the step, or (total_s,), a step
    with no parts (TensorFlow's one traced step: ``fwd_bwd_ms`` and ``step_ms`` are None)."""
    parts = all(len(t) == 2 for t in times)
    fb = [t[0] * 1e3 for t in times] if parts else []
    st = [t[1] * 1e3 for t in times] if parts else []
    tot = [sum(t) * 1e3 for t in times]
    return {"fwd_bwd_ms": median_or_none(fb), "step_ms": median_or_none(st),
            "total_ms": median_or_none(tot), "total_ms_min": min(tot) if tot else None,
            "total_ms_max": max(tot) if tot else None, "steps": len(times),
            "total_ms_steps": [round(t, 3) for t in tot], "error": error}


def add_vs_dense(records):
    """vs_dense = dense total / this total, per model, from the 'dense' record of the same run."""
    dense = {r["model"]: r["total_ms"] for r in records if r["compressor"] == "dense" and r["total_ms"]}
    for r in records:
        d = dense.get(r["model"])
        r["vs_dense"] = d / r["total_ms"] if d and r["total_ms"] else None
    return records


def format_line(r) -> str:
    """One readable progress line (a finished record or a round's partial one)."""
    def ms(v):
        return "-" if v is None else f"{v:.0f}"
    ident = {True: "yes", False: "NO", None: "?"}[r.get("replicas_identical")]
    parts = (f"fwd+bwd {ms(r['fwd_bwd_ms'])} ms  opt.step {ms(r['step_ms'])} ms  "
             if r.get("framework", "torch") == "torch" else "")   # TensorFlow's step has no parts
    line = (f"[step] {r['model']} P={r['np']} {r['link']} {r['compressor']}: {parts}"
            f"step {ms(r['total_ms'])} ms  identical {ident}")
    if r.get("vs_dense") is not None:
        line += f"  {r['vs_dense']:.2f}x dense"
    if r.get("error"):
        line += f"  ERROR {r['error']}"
    return line


# ------------------------------------------------------------------------------- run
def describe_model(name):
    """(description, batch per rank) of a ``--models`` name."""
    if name in MODELS:
        return MODELS[name]
    from horovod_sparse import workloads
    workload = workloads.get(name)
    return workload.DESCRIPTION, workload.BATCH


def auto_summary(compression):
    """What a ``Compression.auto`` compressor chose (None for the others): the plan's name, the
    gradients per choice, the trials' medians and the steps it took to settle."""
    report = getattr(compression, "auto_report", None)
    if report is None:
        return None
    return {"chosen": report.get("chosen"), "per_choice": report.get("per_choice"),
            "trials": {t["plan"]: t["measured_s"] for t in report.get("trials", [])},
            "profile_s": report.get("profile_s"), "settled_at_step": report.get("settled_at_step")}


def schedule_settled(compression):
    """A compressor's ``schedule=`` has made its plan (``"auto"``: and kept one of its
    candidates); True for one without a planned schedule."""
    if getattr(compression, "schedule", "after_backward") == "after_backward":
        return True
    if getattr(compression, "planned", "") is None:  # TensorFlow's wfbp: per Horovod call, no plan
        return True
    report = getattr(compression, "schedule_report", None)
    return report is not None and report.get("chosen") is not None


def schedule_summary(compression):
    """What a planned schedule ran (None without one): the plan kept, its buckets and channels,
    and its last step's timeline in ms after the first gradient arrived (the arrivals' span,
    the collecting call, and when the last bucket's exchange ended)."""
    report = getattr(compression, "schedule_report", None)
    if report is None:
        return None
    timeline = compression.last_step_timeline() or {}
    buckets = timeline.get("buckets") or []
    return {"schedule": report.get("schedule"), "chosen": report.get("chosen"),
            "buckets": len(report.get("buckets") or []), "channels": len(set(report.get("channels") or [0])),
            "arrivals_ms": 1e3 * max(timeline.get("arrived") or [0.0]),
            "finish_ms": None if timeline.get("finish") is None else 1e3 * timeline["finish"],
            "exchanges_end_ms": 1e3 * max((b.get("end", 0.0) for b in buckets), default=0.0)}


def hash_values(arrays):
    """A hash of the values of ``arrays`` (numpy, in order): equal on two ranks only if every
    value is bitwise equal (``replicas_identical``)."""
    import numpy as np
    flat = np.concatenate([np.ravel(a) for a in arrays])
    return hashlib.blake2b(flat.tobytes(), digest_size=16).hexdigest()


def bytes_sent(compression, world_size):
    """Bytes per rank per step as the compressor counts them, or None where it does not count
    (Horovod's own compressors) or its accounting fails (never a reason to fail a run)."""
    per_step = getattr(compression, "bytes_sent_per_step", None)
    if not callable(per_step):
        return None
    try:
        return float(per_step(world_size))
    except Exception:
        return None


def model_and_loss(name, seed, rank, size, model_size=None):
    """(model, loss) of a ``--models`` name: ``loss()`` is one forward pass on this rank's
    batch, the same batch at every step. The model is the same on every rank for the same
    seed; the batch is rank's own (random data for the MLPs, the first batch of rank's shard
    of a real workload). ``model_size``: a real workload's ``build_model`` arguments (``--model``)."""
    import torch
    if name in MODELS:
        torch.manual_seed(seed)
        model, in_shape, out_features = build_model(name)
        gen = torch.Generator().manual_seed(seed + 1000 * (rank + 1))
        batch = MODELS[name][1]
        x = torch.randn((batch,) + in_shape, generator=gen)
        y = torch.randn(batch, out_features, generator=gen)
        loss_fn = torch.nn.MSELoss()
        return model, lambda: loss_fn(model(x), y)
    from horovod_sparse import workloads
    workload = workloads.get(name)
    model = workload.build_model(seed=seed, **(model_size or {}))
    batch = next(workload.batches(rank, size, seed=seed))
    return model, lambda: workload.loss(model, batch)


class StepBench:
    """One rank's state and what both frameworks share: Horovod (started by the subclass), a
    private mpi4py communicator, the watchdog, the warm-up / settling / timed loop, the
    records. A subclass provides the framework:

    - ``framework``: its name in the records (``"torch"``, ``"tensorflow"``);
    - :meth:`init_horovod`: import the framework and Horovod's module for it, ``hvd.init()``;
    - :meth:`frontend`: horovod_sparse's module for it (``Compression.from_spec``);
    - :meth:`model_size`: (parameters, tensors) of a model;
    - :meth:`make_step`: a fresh model, its optimizer under Horovod, one step, its values;
    - :meth:`copier`: one copy of a float32 buffer (the memory bound);
    - :meth:`framework_fields` and :meth:`model_extras`: what its records add.
    """

    framework = None

    def __init__(self, args):
        self.args = args
        self.hvd = self.init_horovod()
        from mpi4py import MPI   # after hvd.init(): Horovod initialises MPI (thread multiple)
        self.MPI = MPI
        from horovod_sparse.agreement import communicator_of
        self.comm = communicator_of(None).Dup()   # Horovod's ranks, ours alone beside Horovod's
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.partial = {}   # spec -> this model's record, accumulated over the rounds

    # -- what a framework provides ------------------------------------------------------
    def init_horovod(self):
        """Import the framework and Horovod's module for it, call ``hvd.init()``, return it."""
        raise NotImplementedError

    def frontend(self):
        """horovod_sparse's frontend module of this framework (its ``Compression``)."""
        raise NotImplementedError

    def model_size(self, model_name):
        """(parameters, parameter tensors) of a ``--models`` name."""
        raise NotImplementedError

    def make_step(self, model_name, compression):
        """(step, values) for one run: ``step()`` runs one training step of a fresh model (the
        same on every rank) through Horovod with ``compression`` and returns its seconds as a
        tuple (see :func:`summarize`); ``values()`` are the model's parameters (numpy arrays),
        hashed for ``replicas_identical``."""
        raise NotImplementedError

    def copier(self, n):
        """A function that copies a float32 buffer of ``n`` elements once."""
        raise NotImplementedError

    def framework_fields(self):
        """Fields of every record of this framework: ``threads`` per rank and versions."""
        raise NotImplementedError

    def model_extras(self, model_name):
        """Fields measured once per model, added to its records (none by default)."""
        return {}

    # -- helpers ---------------------------------------------------------------------
    def say(self, text):
        if self.rank == 0:
            print(text, flush=True)

    def max_over_ranks(self, values):
        from horovod_sparse.agreement import max_over_ranks
        return max_over_ranks(self.comm, values)

    def gather_verdicts(self, error, digest):
        """Every rank's ``(error, digest)``, as text in buffers, not pickles: Horovod's collectives
        (a Gloo launch, ``HOROVOD_SPARSE_TRANSPORT=horovod``) carry them too."""
        from horovod_sparse.agreement import allgather_text
        return [tuple(json.loads(t)) for t in allgather_text(self.comm, json.dumps([error, digest]))]

    def make_compression(self, spec):
        if is_horovod_spec(spec):
            return getattr(self.hvd.Compression, HOROVOD_COMPRESSORS[spec])
        return self.frontend().Compression.from_spec(spec)

    def copy_ms(self, n):
        """Median over repeats of the max over ranks of one float32 copy of n elements
        (both ranks copy at once, as they compute at once in training)."""
        copy = self.copier(n)
        times = []
        for i in range(self.args.copy_repeats + 1):
            self.comm.Barrier()
            t0 = time.perf_counter()
            copy()
            times.append(time.perf_counter() - t0)
        return statistics.median(self.max_over_ranks(times[1:]).tolist()) * 1e3

    def run_steps(self, step, compression=None):
        """``--warmup`` untimed steps, then (for ``Compression.auto``) more until it settles,
        then ``--steps`` timed ones: this rank's times of the timed steps. Every step starts
        after a barrier (not timed), so that all ranks start it together."""
        def synchronized():
            self.comm.Barrier()
            return step()

        for _ in range(self.args.warmup):
            synchronized()
        # Compression.auto decides in its first steps (profiling, trials): those are warm-up
        # too, so that the timed steps are its settled plan's (the same phase on every rank)
        # and so are a planned schedule's profiled and tried steps
        for _ in range(self.args.warmup, MAX_SETTLING_STEPS):
            if getattr(compression, "phase", "settled") == "settled" and schedule_settled(compression):
                break
            synchronized()
        return [synchronized() for _ in range(self.args.steps)]

    # -- one compressor, one round ----------------------------------------------------
    def run_one(self, model_name, spec):
        """Returns (times [one tuple of seconds per step], digest, bytes_sent, error message or None)."""
        times, digest, sent, error, compression = [], None, None, None, None
        self.auto_choice = self.schedule_ran = None
        try:
            compression = self.make_compression(spec)
            step, values = self.make_step(model_name, compression)
            times = self.run_steps(step, compression)
            digest = hash_values(values())
            self.auto_choice = auto_summary(compression)
            self.schedule_ran = schedule_summary(compression)
            sent = bytes_sent(compression, self.size)
        except Exception as e:   # recorded; the caller decides whether the job can go on
            error = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        finally:
            close = getattr(compression, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as e:
                    error = error or f"close: {type(e).__name__}: {e}"[:300]
        return times, digest, sent, error

    # -- the watchdog ---------------------------------------------------------------
    def _start_watchdog(self, what, spec):
        def fire():
            print(f"[step] rank {self.rank}: {what} exceeded --timeout {self.args.timeout:.0f} s; "
                  "writing what was measured and aborting the job", flush=True)
            try:
                if self.rank == 0:
                    self.flush_partial(spec, f"timeout after {self.args.timeout:.0f} s (job aborted)")
                else:
                    time.sleep(10)   # let rank 0 write first: Abort kills every rank
            finally:
                self.MPI.COMM_WORLD.Abort(3)
        timer = threading.Timer(self.args.timeout, fire)
        timer.daemon = True
        timer.start()
        return timer

    def flush_partial(self, spec, reason):
        """Write the records still being accumulated (rank 0), the one of ``spec`` marked
        with ``reason``; the others keep the steps measured so far."""
        pending = list(self.partial.values())
        if spec in self.partial:
            self.partial[spec]["error"] = self.partial[spec]["error"] or reason
        self.write(add_vs_dense(pending))
        self.partial = {}

    def write(self, records):
        if self.rank == 0 and self.args.out:
            os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
            with open(self.args.out, "a") as f:
                for r in records:
                    f.write(json.dumps(r) + "\n")

    # -- one model ------------------------------------------------------------------
    def base_record(self, model_name, n_params, n_tensors, copy_ms, extras=None):
        import horovod
        a = self.args
        nbytes = dense_bytes(n_params, self.size)
        desc, batch = describe_model(model_name)
        return {
            "bench": "step", "framework": self.framework,
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "model": model_name, "model_desc": desc, "params": n_params,
            "tensors": n_tensors, "batch": batch, "np": self.size, "link": a.link,
            "link_bps": link_bps(a.link), "warmup": a.warmup, "steps_per_round": a.steps,
            "rounds": a.rounds, "lr": a.lr, "recipe": a.recipe, "model_size": a.model, "copy_ms": copy_ms,
            "dense_bytes": nbytes,
            "link_ms": link_ms(nbytes, a.link), **self.framework_fields(), **(extras or {}),
            "host": socket.gethostname(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "horovod": horovod.__version__, "note": a.note,
            "command": shlex.join(["python", "-m", "horovod_sparse.bench.step"] + sys.argv[1:]),
            "driver_command": os.environ.get(DRIVER_ENV),
        }

    def run_model(self, model_name):
        """All rounds of all compressors on one model. Returns False if the job must stop."""
        a = self.args
        n_params, n_tensors = self.model_size(model_name)
        copies = []
        framework = "" if self.framework == "torch" else f" ({self.framework})"
        self.say(f"[step] model {model_name}{framework}: {n_params:,} parameters in {n_tensors} tensors, "
                 f"batch {describe_model(model_name)[1]}, P={self.size}, link {a.link}, "
                 f"{a.rounds} round(s) x {len(a.compressors)} compressors x ({a.warmup} + {a.steps}) steps")
        extras = self.model_extras(model_name)
        times = {spec: [] for spec in a.compressors}
        self.partial = {}
        ok = True
        for rnd in range(a.rounds):
            copies.append(self.copy_ms(n_params))   # per round: it drifts like the rest
            if rnd == 0:
                base = self.base_record(model_name, n_params, n_tensors, copies[0], extras)
                self.say(f"[step] bounds: one copy of {n_params * 4 / 1e6:.1f} MB {copies[0]:.1f} ms; "
                         f"dense sends {base['dense_bytes'] / 1e6:.1f} MB/rank/step"
                         + (f" = {base['link_ms']:.0f} ms at {a.link}" if base["link_ms"] else "")
                         + (f"; local step (no Horovod) {extras['compute_ms']:.1f} ms"
                            if extras.get("compute_ms") is not None else ""))
            for spec in a.compressors:
                rec = self.partial.setdefault(spec, {**base, "compressor": spec, **summarize([]),
                                                     "replicas_identical": None, "bytes_sent_per_step": None})
                if rec["error"] is not None:
                    continue   # failed in an earlier round: do not retry
                watchdog = self._start_watchdog(f"{model_name} {spec} round {rnd + 1}", spec)
                try:
                    mine, digest, sent, error = self.run_one(model_name, spec)
                    # the run's model and optimizer live on in reference cycles through Horovod's
                    # hooks until the cycle collector runs: free them now (at P = 4, 12 runs of a
                    # 117 MB model grew a rank past 6 GB here), so no run pays for the one before
                    gc.collect()
                    verdicts = self.gather_verdicts(error, digest)
                finally:
                    watchdog.cancel()
                errors = [e for e, _ in verdicts]
                if not any(errors):   # decided on the gathered verdicts: the same on every rank
                    times[spec].extend(tuple(t) for t in self.max_over_ranks(mine).tolist())
                rec["copy_ms"] = statistics.median(copies)
                if is_horovod_spec(spec):   # Horovod counts nothing: its ring allreduce's bytes
                    sent = base["dense_bytes"] / (2 if spec == "hvd-fp16" else 1)
                rec["bytes_sent_per_step"] = sent
                if self.auto_choice is not None:   # what Compression.auto chose, round by round
                    rec.setdefault("auto", []).append(self.auto_choice)
                if self.schedule_ran is not None:  # what a planned schedule ran, round by round
                    rec.setdefault("schedule", []).append(self.schedule_ran)
                if any(errors):
                    rec["error"] = next(e for e in errors if e)
                    if len(set(errors)) > 1:   # not every rank failed alike: Horovod may be stuck
                        rec["error"] += " (ranks disagree; job stopped)"
                        ok = False
                else:
                    same = len({d for _, d in verdicts}) == 1
                    rec["replicas_identical"] = same and rec["replicas_identical"] is not False
                rec.update(summarize(times[spec], rec["error"]))
                rec["timestamp"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
                self.say(format_line(rec) + (f"  (round {rnd + 1}/{a.rounds})" if a.rounds > 1 else ""))
                if not ok:
                    break
            if not ok:
                break
        records = add_vs_dense(list(self.partial.values()))
        self.partial = {}
        self.write(records)
        self.say(f"[step] summary {model_name}, P={self.size}, link {a.link}, medians of "
                 f"{a.rounds} x {a.steps} steps:")
        for r in records:
            self.say(format_line(r))
        return ok


class Bench(StepBench):
    """PyTorch: ``hvd.DistributedOptimizer`` over plain SGD (or ``--recipe``'s optimizer); a step
    is ``zero_grad``, forward and ``backward()`` (Horovod's hooks start the exchanges), then
    ``opt.step()`` (Horovod's ``synchronize()``, decompress, the update), timed as those two parts."""

    framework = "torch"

    def init_horovod(self):
        import horovod.torch as hvd
        import torch
        hvd.init()
        self.torch = torch
        return hvd

    def frontend(self):
        import horovod_sparse.torch as hvds
        return hvds

    def model_size(self, model_name):
        model, _ = model_and_loss(model_name, self.args.seed, self.rank, self.size, self.args.model)
        return sum(p.numel() for p in model.parameters()), sum(1 for _ in model.parameters())

    def params_digest(self, model):
        """The hash of ``model``'s parameters (also :mod:`~horovod_sparse.bench.tta`'s)."""
        return hash_values([p.detach().cpu().numpy() for p in model.parameters()])

    def make_step(self, model_name, compression):
        torch, hvd, args = self.torch, self.hvd, self.args
        model, loss = model_and_loss(model_name, args.seed, self.rank, self.size, args.model)  # same everywhere ...
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)                              # ... made sure of
        opt = hvd.DistributedOptimizer(self.optimizer(model, model_name),
                                       named_parameters=model.named_parameters(),
                                       compression=compression)

        def step():
            """One step: (forward + backward seconds, opt.step() seconds)."""
            t0 = time.perf_counter()
            opt.zero_grad()
            loss().backward()                 # Horovod's hooks call compress here
            t1 = time.perf_counter()
            opt.step()                        # synchronize(): exchanges, decompress, SGD
            return t1 - t0, time.perf_counter() - t1
        return step, lambda: [p.detach().cpu().numpy() for p in model.parameters()]

    def optimizer(self, model, model_name):
        """The optimizer Horovod wraps: plain SGD at ``--lr``, or ``--recipe``'s at the model's own
        rate (its schedule left out: a rate's value does not change a step's time)."""
        a = self.args
        if a.recipe is None:
            return self.torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.0)
        from horovod_sparse import workloads
        workload = workloads.get(model_name) if model_name in WORKLOADS else None
        return recipe_for(workload, a.recipe, a.lr).optimizer(model.parameters())

    def copier(self, n):
        src, dst = self.torch.randn(n), self.torch.empty(n)
        return lambda: dst.copy_(src)

    def framework_fields(self):
        return {"threads": self.torch.get_num_threads(), "torch": self.torch.__version__}


class TFBench(StepBench):
    """TensorFlow: ``hvd.DistributedGradientTape`` in a ``tf.function``, one timed call per step;
    once per model the same step without Horovod as the compute floor (``compute_ms``). The
    TensorFlow side is :class:`horovod_sparse.bench.step_tf.TFRunner`'s."""

    framework = "tensorflow"

    def init_horovod(self):
        from horovod_sparse.bench.step_tf import TFRunner   # TensorFlow only when asked for
        self.runner = TFRunner(self.args)
        return self.runner.hvd

    def frontend(self):
        return self.runner.frontend()

    def model_size(self, model_name):
        return self.runner.model_size(model_name, self.rank)

    def make_step(self, model_name, compression):
        return self.runner.horovod_step(model_name, self.rank, compression)

    def model_extras(self, model_name):
        """``compute_ms``: the median (max over ranks) of the step without Horovod, warm-up and
        timed steps as a compressor's: the floor every compressor's step stands on."""
        times = self.max_over_ranks(self.run_steps(self.runner.local_step(model_name, self.rank)))
        return {"compute_ms": statistics.median(t[0] for t in times.tolist()) * 1e3}

    def copier(self, n):
        return self.runner.copier(n)

    def framework_fields(self):
        return self.runner.fields()


def bench_class(framework):
    """The :class:`StepBench` of ``framework``."""
    return TFBench if framework == "tensorflow" else Bench


def run(args) -> int:
    # the steady step: a compressor's warm-up (horovod_sparse.warmup) would time dense steps instead,
    # unless its spec names warmup_steps
    os.environ.setdefault("HOROVOD_SPARSE_WARMUP_STEPS", "0")
    bench = bench_class(args.framework)(args)
    if bench.rank == 0 and args.out:
        print(f"[step] appending records to {args.out}", flush=True)
    for model_name in args.models:
        if not bench.run_model(model_name):
            bench.say("[step] stopping: a run failed on some ranks only, Horovod may be left mid-collective")
            return 1
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print("\n".join(DEFAULT_COMPRESSORS))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
