"""Time to accuracy: train one real workload with each compressor from the same initial model,
and record the validation metric against steps and against training seconds. Run it under
MPI, one process per rank:

    mpirun -np 2 python -m horovod_sparse.bench.tta --workload digits_resnet --steps 300 \\
        --compressors hvd-none hvd-fp16 topk:density=0.01 ddp-powersgd --out results/tta.jsonl
    python scripts/netem.py --rate 1gbit -np 2 -- python -m horovod_sparse.bench.tta ...

(``scripts/bench_tta.py`` does the second for every workload and link and writes
docs/results/accuracy.md.)

Per compressor, one after the other in one job:

* **Horovod** (``hvd-none``, ``hvd-fp16``: Horovod's own compressors, as
  :mod:`horovod_sparse.bench.step` names them) and **ours** (any ``horovod_sparse`` spec,
  ``schedule=`` ones included): the workload's seeded model (then
  ``hvd.broadcast_parameters``), the recipe's optimizer, the stock
  ``hvd.DistributedOptimizer(compression=...)``.
* **PyTorch DDP over gloo**, the peers: ``ddp-none`` (dense), ``ddp-fp16``
  (``fp16_compress_hook``), ``ddp-powersgd`` (``powerSGD_hook`` with the state of its
  documentation's example: rank 1, ``start_powerSGD_iter=10`` plain allreduce steps first,
  ``min_compression_rate=0.5``; error feedback and warm start on, their defaults). Stock
  ``DistributedDataParallel`` otherwise (its buffers broadcast from rank 0 each forward).
  A fresh process group per run: rank 0 opens a ``TCPStore`` on a free port of its own
  address (127.0.0.1 on loopback; under ``scripts/netem.py`` the address of its
  namespace's interface) and passes the port over MPI. Gloo's own timeout
  (``--ddp-timeout``) turns a hung collective into an error, recorded like any other.

The same recipe for every compressor (``--recipe``, :mod:`horovod_sparse.workloads.recipes`:
``adamw``, ``momentum`` or ``sgd``, with warm-up and cosine decay over ``--steps``; default
the workload's own: AdamW for the language model, momentum SGD for ResNet-18), the
workload's batch per rank and its stream of batches (the same examples at every step for
every compressor), the same seed. ``--model layers=4,d_model=256`` sizes the language model.
Each compressor runs with its own defaults beyond its spec (DDP's PowerSGD has the ones above).

Every ``--eval-every`` steps, and at the start and the end, the training clock stops and
rank 0 evaluates its replica (the parameters of all replicas are the same, which is checked
at the end; ResNet-18's BatchNorm running statistics are each rank's own, and rank 0's are
the ones evaluated): one curve point ``{step, seconds, metric, loss, train_loss}``, where
``seconds`` is training time so far (the slowest rank's, data loading included, evaluation
left out), ``loss`` the validation loss and ``train_loss`` rank 0's mean training loss since
the previous point. A run ends at the first evaluation where ``--steps`` or ``--seconds`` is
reached (the seconds budget is checked there only: every rank must stop at the same step).
After the last step the ranks compare a hash of their parameters (``replicas_identical``).

Rank 0 appends one JSON object per (workload, link, compressor) run to ``--out`` as soon as
the run ends. An error in one run is recorded and the next one runs; if the ranks disagree
about a Horovod error (a collective may be left half done) or a run exceeds ``--timeout``,
the job writes what it has and stops. ``--started FILE``: rank 0 writes the name of the run
it starts there, so a driver can tell which run a job that died was in.

Importing this module imports only the standard library: torch, Horovod, numpy and mpi4py
are imported by :func:`run`, so the argument parsing can be used (and tested) without them.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import ipaddress
import math
import os
import platform
import shlex
import socket
import struct
import sys
import time

from horovod_sparse.bench.step import (DRIVER_ENV, RATE_ENV, Bench, _link, _positive, auto_summary,
                                       is_horovod_spec, link_bps)
from horovod_sparse.workloads import NAMES  # stdlib only at import, like this module
from horovod_sparse.workloads import parse_size
from horovod_sparse.workloads.recipes import recipe_spec
from horovod_sparse.workloads.recipes import recipe_for

#: The peers, by the names this benchmark gives them.
DDP_PEERS = ("ddp-none", "ddp-fp16", "ddp-powersgd")

#: Horovod's dense and fp16, each compressor family's representative, and the DDP peers.
DEFAULT_COMPRESSORS = (
    "hvd-none", "hvd-fp16", "topk:density=0.01", "oktopk:density=0.01", "randomk:density=0.01",
    "powersgd", "efsignsgd", "qsgd", "fft", *DDP_PEERS,
)

#: PowerSGDState of the hook's documentation's example (torch's powerSGD_hook.py).
DDP_POWERSGD = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 10, "min_compression_rate": 0.5}

_SIOCGIFADDR = 0x8915


# --------------------------------------------------------------------------- arguments
def _positive_float(text: str) -> float:
    v = float(text)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m horovod_sparse.bench.tta",
        description="Train one workload with each compressor and record the validation metric "
                    "against steps and training seconds (run under mpirun; rank 0 writes JSON lines).")
    p.add_argument("--workload", default="digits_resnet", choices=NAMES, help="default: digits_resnet")
    p.add_argument("--compressors", nargs="+", default=list(DEFAULT_COMPRESSORS), metavar="SPEC",
                   help="hvd-none, hvd-fp16 (Horovod's own), ddp-none, ddp-fp16, ddp-powersgd (PyTorch "
                        "DDP over gloo), or a horovod_sparse spec (default: see --list)")
    p.add_argument("--steps", type=_positive, default=None, help="step budget per compressor")
    p.add_argument("--seconds", type=_positive_float, default=None,
                   help="training-time budget per compressor (checked at each evaluation)")
    p.add_argument("--eval-every", type=_positive, default=20, help="steps between evaluations (default 20)")
    p.add_argument("--batch", type=_positive, default=None, help="batch per rank (default: the workload's)")
    p.add_argument("--recipe", default=None, type=recipe_spec,
                   help="optimizer and schedule (default: the workload's own; see horovod_sparse.workloads.recipes)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the recipe's)")
    p.add_argument("--model", type=parse_size, default={}, metavar="KEY=INT,...",
                   help="model size, e.g. layers=4,d_model=256,heads=4 (the language model; default its own)")
    p.add_argument("--seed", type=int, default=0, help="model and data seed (default 0)")
    p.add_argument("--link", type=_link, default=None,
                   help=f"the link's tc rate, for the record (default: ${RATE_ENV} set by "
                        "scripts/netem.py, else loopback)")
    p.add_argument("--timeout", type=float, default=3600.0,
                   help="seconds one compressor run may take before the job writes what it has and "
                        "aborts (default 3600)")
    p.add_argument("--ddp-timeout", type=float, default=300.0,
                   help="gloo's timeout for one DDP collective, in seconds (default 300)")
    p.add_argument("--out", default=None, help="append JSON lines here (rank 0)")
    p.add_argument("--started", default=None, help="rank 0 writes the name of each run here as it starts")
    p.add_argument("--note", default="", help="free text stored in every record")
    p.add_argument("--list", action="store_true", help="print the default compressor list and exit")
    return p


def parse_args(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.link is None:
        args.link = _link(os.environ.get(RATE_ENV, "loopback"))
    if args.steps is None and args.seconds is None and not args.list:
        parser.error("give a budget: --steps N and/or --seconds S")
    return args


def kind_of(spec: str) -> str:
    """``"horovod"`` (Horovod's own compressors), ``"ddp"`` (the peers) or ``"ours"``."""
    return "horovod" if is_horovod_spec(spec) else "ddp" if spec in DDP_PEERS else "ours"


def describe(error, where=None):
    """One line of at most 300 characters for the record."""
    text = f"{type(error).__name__}: {error}".splitlines()[0]
    return (f"{where}: {text}" if where else text)[:300]


def finite_or_none(value):
    """A float, or None for NaN and infinities (a diverged run; JSON has no NaN)."""
    value = float(value)
    return value if math.isfinite(value) else None


# ----------------------------------------------------------------------- the peers' address
def ipv4_interfaces():
    """``{interface name: IPv4 address}`` of this network namespace (Linux)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:   # no IPv4 address
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def gloo_interface(link, interfaces=None, subnet=None):
    """``(interface, address)`` the DDP peers use on this rank: ``lo`` on loopback; under
    scripts/netem.py the namespace's own interface (in ``subnet``, which netem.py hands the
    ranks as ``PMIX_MCA_ptl_tcp_if_include``, where given).

    >>> gloo_interface("loopback")
    ('lo', '127.0.0.1')
    >>> gloo_interface("1gbit", {"lo": "127.0.0.1", "eth0": "198.18.0.2"}, "198.18.0.0/24")
    ('eth0', '198.18.0.2')
    """
    if link == "loopback":
        return "lo", "127.0.0.1"
    interfaces = ipv4_interfaces() if interfaces is None else interfaces
    subnet = os.environ.get("PMIX_MCA_ptl_tcp_if_include") if subnet is None else subnet
    candidates = [(n, a) for n, a in sorted(interfaces.items()) if not ipaddress.ip_address(a).is_loopback]
    try:
        net = ipaddress.ip_network(subnet) if subnet else None
    except ValueError:   # a list of interfaces, not a subnet
        net = None
    if net is not None:
        candidates = [(n, a) for n, a in candidates if ipaddress.ip_address(a) in net]
    if len(candidates) != 1:
        raise RuntimeError(f"cannot tell which interface the DDP peers should use on link {link}: "
                           f"{candidates or 'none'} (expected one, as inside scripts/netem.py's namespaces)")
    return candidates[0]


# ------------------------------------------------------------------------------- run
class TimeToAccuracy(Bench):
    """One rank's state. From :class:`~horovod_sparse.bench.step.Bench`: Horovod, the private
    communicator, the watchdog, the parameter hash, the compressor by its spec, the writer."""

    def __init__(self, args):
        super().__init__(args)
        from horovod_sparse import workloads
        self.workload = workloads.get(args.workload)
        self.batch = args.batch or self.workload.BATCH
        self.recipe = recipe_for(self.workload, args.recipe, args.lr)
        model = self.build_model()
        self.size_of_model = {"params": sum(p.numel() for p in model.parameters()),
                              "tensors": sum(1 for _ in model.parameters())}
        self.current = None   # the record of the run under way (rank 0 fills its curve)

    def build_model(self):
        """The workload's model from the seed, at ``--model``'s size: the same on every rank."""
        return self.workload.build_model(seed=self.args.seed, **self.args.model)

    # -- records ----------------------------------------------------------------------
    def base_record(self, spec):
        import horovod
        a, w = self.args, self.workload
        return {
            "bench": "tta", "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "workload": a.workload, "metric": w.METRIC, "higher_is_better": w.HIGHER_IS_BETTER,
            **self.size_of_model,
            "compressor": spec, "kind": kind_of(spec), "np": self.size, "link": a.link,
            "link_bps": link_bps(a.link), "batch": self.batch, "recipe": self.recipe.record(),
            "lr": self.recipe.lr, "momentum": self.recipe.momentum, "model_size": a.model, "seed": a.seed,
            "budget_steps": a.steps, "budget_seconds": a.seconds, "eval_every": a.eval_every,
            "ddp_powersgd": DDP_POWERSGD if spec == "ddp-powersgd" else None,
            "curve": [], "steps": 0, "seconds": 0.0, "eval_seconds": 0.0,
            "replicas_identical": None, "error": None,
            "threads": self.torch.get_num_threads(), "host": socket.gethostname(), "cpus": os.cpu_count(),
            "python": platform.python_version(), "torch": self.torch.__version__,
            "horovod": horovod.__version__, "note": a.note,
            "command": shlex.join(["python", "-m", "horovod_sparse.bench.tta"] + sys.argv[1:]),
            "driver_command": os.environ.get(DRIVER_ENV),
        }

    def flush_partial(self, spec, reason):
        """The watchdog's last word (rank 0): the run under way, with the curve so far."""
        if self.current is not None:
            self.current["error"] = self.current["error"] or reason
            self.write([self.current])
            self.current = None

    # -- the two ways to train ----------------------------------------------------------
    def horovod_setup(self, spec, model, cleanup):
        hvd = self.hvd
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        compression = self.make_compression(spec)
        self.compression = compression
        close = getattr(compression, "close", None)
        if callable(close):
            cleanup.append(close)
        recipe = self.recipe.for_compressor(spec)
        self.current["optimizer_momentum"] = recipe.momentum
        opt = recipe.optimizer(model.parameters())
        return model, hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                               compression=compression)

    def ddp_setup(self, spec, model, cleanup):
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel
        interface, address = gloo_interface(self.args.link)
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        master = self.comm.bcast(address, root=0)
        timeout = _dt.timedelta(seconds=self.args.ddp_timeout)
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", self.rank))
        size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", self.size))
        # port 0: a free port, never one another job on this machine holds; the others learn it over MPI
        store = (dist.TCPStore(master, 0, size, is_master=True, timeout=timeout, wait_for_workers=False)
                 if rank == 0 else None)
        port = self.comm.bcast(store.port if store else None, root=0)
        if store is None:
            store = dist.TCPStore(master, port, size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
        cleanup.append(dist.destroy_process_group)
        net = DistributedDataParallel(model)
        if spec == "ddp-fp16":
            net.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif spec == "ddp-powersgd":
            state = powerSGD_hook.PowerSGDState(process_group=None, **DDP_POWERSGD)
            net.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        if self.rank == 0:
            self.current["ddp_master"] = f"{master}:{port}"
        return net, self.recipe.optimizer(net.parameters())

    # -- one compressor -----------------------------------------------------------------
    def evaluate(self, model, step, clock, losses):
        """One curve point on rank 0, the training clock stopped; the others wait. Returns
        (this rank's error message or None, whether any rank failed): every rank reaches the
        closing all-reduce either way, and all learn the same."""
        error = None
        if self.rank == 0:
            try:
                t0 = time.perf_counter()
                result = self.workload.evaluate(model)
                point = {"step": step, "seconds": round(clock, 4),
                         "metric": finite_or_none(result[self.workload.METRIC]),
                         "loss": finite_or_none(result["loss"]),
                         "train_loss": finite_or_none(sum(losses) / len(losses)) if losses else None}
                rec = self.current
                rec["curve"].append(point)
                rec["steps"], rec["seconds"] = step, point["seconds"]
                rec["eval_seconds"] += time.perf_counter() - t0
                self.say(f"[tta] {rec['workload']} {rec['link']} {rec['compressor']}: step {step} "
                         f"{clock:.1f} s {self.workload.METRIC} {point['metric']} loss {point['loss']}")
            except Exception as e:
                error = describe(e, "evaluation")
        return error, bool(self.max_over_ranks([error is not None])[0])

    def train(self, spec):
        """One run: returns (parameter digest, error message or None).

        A rank whose step raises skips the rest of its segment and says so in the segment's
        closing all-reduce, so the ranks leave the loop together and meet in the next MPI
        collective (a DDP peer left waiting in gloo gets gloo's timeout first)."""
        a = self.args
        cleanup, digest, error = [], None, None
        self.compression = None
        try:
            model = self.build_model()                       # the same on every rank ...
            setup = self.ddp_setup if kind_of(spec) == "ddp" else self.horovod_setup
            net, opt = setup(spec, model, cleanup)           # ... and made sure of
            # a --seconds budget alone has no last step to decay to: the rate then stays at its peak
            schedule = self.recipe.schedule(opt, a.steps) if a.steps else None
            batches = self.workload.batches(self.rank, self.size, self.batch, seed=a.seed)
            step, clock = 0, 0.0
            error, failed = self.evaluate(model, step, clock, [])
            while not failed:
                todo = a.eval_every if a.steps is None else min(a.eval_every, a.steps - step)
                losses = []
                self.comm.Barrier()   # the clock starts with every rank
                t0 = time.perf_counter()
                try:
                    for _ in range(todo):
                        opt.zero_grad()
                        loss = self.workload.loss(net, next(batches))
                        loss.backward()
                        opt.step()
                        if schedule is not None:
                            schedule.step()
                        losses.append(loss.item())
                except Exception as e:
                    error = describe(e)
                elapsed = time.perf_counter() - t0
                step += todo
                slowest, failed = self.max_over_ranks([elapsed, error is not None])   # the same on every rank
                clock += float(slowest)
                if failed:
                    break
                error, failed = self.evaluate(model, step, clock, losses)
                if (a.steps is not None and step >= a.steps) or (a.seconds is not None and clock >= a.seconds):
                    break
            if not error:
                digest = self.params_digest(model)
            self.current["auto"] = auto_summary(self.compression)
        except Exception as e:   # recorded; the caller decides whether the job can go on
            error = describe(e)
        finally:
            for undo in reversed(cleanup):
                try:
                    undo()
                except Exception as e:
                    error = error or describe(e, "cleanup")
        return digest, error

    def run_one(self, spec):
        """Train, check the replicas, write the record. Returns False if the job must stop."""
        self.current = self.base_record(spec)
        if self.rank == 0 and self.args.started:
            with open(self.args.started, "w") as f:
                f.write(spec + "\n")
        watchdog = self._start_watchdog(f"{self.args.workload} {spec}", spec)
        try:
            digest, error = self.train(spec)
            verdicts = self.comm.allgather((error, digest))
        finally:
            watchdog.cancel()
        rec, ok = self.current, True
        errors = [e for e, _ in verdicts if e]
        if errors:
            rec["error"] = errors[0]
            if len(set(e for e, _ in verdicts)) > 1:
                if rec["kind"] == "ddp":   # gloo's own group, gone with the run: Horovod is untouched
                    rec["error"] = " | ".join(f"rank {r}: {e}" for r, (e, _) in enumerate(verdicts) if e)
                else:   # not every rank failed alike: Horovod may be stuck mid-collective
                    rec["error"] += " (ranks disagree; job stopped)"
                    ok = False
        else:
            rec["replicas_identical"] = len({d for _, d in verdicts}) == 1
        rec["timestamp"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
        self.write([rec])
        self.current = None
        self.say(format_line(rec))
        return ok


def format_line(r) -> str:
    """One readable line per finished run."""
    last = r["curve"][-1] if r["curve"] else {}
    ident = {True: "yes", False: "NO", None: "?"}[r.get("replicas_identical")]
    line = (f"[tta] {r['workload']} P={r['np']} {r['link']} {r['compressor']}: {r['steps']} steps "
            f"{r['seconds']:.1f} s {r['metric']} {last.get('metric')}  identical {ident}")
    return line + (f"  ERROR {r['error']}" if r.get("error") else "")


def run(args) -> int:
    bench = TimeToAccuracy(args)
    bench.say(f"[tta] {args.workload}, P={bench.size}, link {args.link}, batch {bench.batch}/rank, "
              f"recipe {bench.recipe}, budget {args.steps} steps / {args.seconds} s, "
              f"evaluation every {args.eval_every} steps" + (f"; appending to {args.out}" if args.out else ""))
    for spec in args.compressors:
        if not bench.run_one(spec):
            bench.say("[tta] stopping: a run failed on some ranks only, Horovod may be left mid-collective")
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
