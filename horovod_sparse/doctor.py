"""``horovod-sparse doctor``: checks a launch before a long job, run the way the job will be.

    mpirun -np 2 --bind-to none --mca mpi_yield_when_idle 1 horovod-sparse doctor
    horovodrun -np 2 horovod-sparse doctor

Every rank initialises Horovod (unless a frontend already runs, as in a test), runs the
checks below, and rank 0 prints one line per check: OK, WARN or FAIL, what was found, and
for WARN and FAIL the fix. Every rank exits with the same code: 0 when the launch is sound
(warnings allowed), 1 when a check failed.

- ``world``: the exchanges' transport among Horovod's ranks (:mod:`horovod_sparse.world`):
  mpi4py where its world is Horovod's, Horovod's own collectives otherwise (a Gloo launch),
  and why. Where neither serves, each rank learns it alone, no collective runs after it (it
  could wait forever), and the rest of the report is this rank's only.
- ``mpi``, ``horovod``, ``cuda``, ``versions``: what was installed and how it was built;
  ``switches``: the package's environment switches, each one of its choices.
- ``cores``: ranks on this node against the cores they may run on; ranks that outnumber
  them must yield while they wait in MPI (Open MPI's ``mpi_yield_when_idle``), or they
  busy-poll and steal each other's cores.
- ``threads``: the framework's threads per rank times the node's ranks against its cores.
- ``link``: a short buffer-based allreduce between the ranks, as a bandwidth and a latency;
  ``whatif``: what the what-if model (:mod:`horovod_sparse.whatif`) predicts from them for a
  model profile (a shipped one by default, ``--profile`` for the user's own trace).

Every collective runs on Horovod's ranks in the same order on all of them, and a watchdog
ends a rank that waits longer than ``--timeout`` seconds.
"""
import importlib.metadata
import json
import math
import os
import platform
import sys
import threading

import numpy as np

OK, WARN, FAIL = "OK", "WARN", "FAIL"
_SEVERITY = {OK: 0, WARN: 1, FAIL: 2}

#: the profile the link check predicts for (a shipped trace: no profiling needed)
DEFAULT_PROFILE = "netai:resnet50"
#: compressors the link check compares with dense, where the profile names none
DEFAULT_COMPRESSORS = ("hvd-fp16", "topk:density=0.01")
#: allreduce sizes timed for the link's a + b*M (bytes): the smallest gives the latency, the
#: largest the bandwidth; a second in all
PROBE_BYTES = (64, 4 << 20)
#: the Open MPI parameter that makes a waiting rank yield its core, as mpirun exports it
YIELD_VARIABLE = "OMPI_MCA_mpi_yield_when_idle"
#: Open MPI's parameter files, read after the environment (the user's, then Debian's system one)
MCA_PARAM_FILES = ("~/.openmpi/mca-params.conf", "/etc/openmpi/openmpi-mca-params.conf")
YIELD_FIX = ("pass `--mca mpi_yield_when_idle 1` to mpirun (horovodrun: `--mpi-args=\"--oversubscribe "
             "--mca mpi_yield_when_idle 1\"`), or launch fewer ranks per node")


def check(name, status, found, fix=""):
    """One line of the report."""
    return {"check": name, "status": status, "found": found, "fix": fix}


# ----------------------------------------------------------------------- the checks
def check_world():
    """The communicator the out-of-band exchanges run on (:func:`horovod_sparse.world.horovod_world`):
    mpi4py's where it maps Horovod's ranks, else Horovod's collectives, with the transport and
    why. Returns ``(check, communicator or None)``."""
    from horovod_sparse import world
    hvd = world.horovod_frontend()
    try:
        comm = world.horovod_world()
    except world.HorovodWorldError as e:
        return check("world", FAIL, str(e).split(". Launch")[0],
                     "launch through MPI: `mpirun -np N ...`, or `horovodrun -np N ...` with Horovod's "
                     "MPI controller (not --gloo, nor elastic mode)"), None
    if not getattr(comm, "point_to_point", True):
        return check("world", OK, f"{hvd.size()} rank(s); transport: {comm.transport} ({comm.reason})"), comm
    mpi_size = world.mpi_world().Get_size()
    if hvd.size() == mpi_size:
        found = f"mpi4py's world is Horovod's: {hvd.size()} rank(s); transport: mpi4py"
    else:
        found = f"Horovod runs on {hvd.size()} of mpi4py's {mpi_size} processes; the exchanges use those; transport: mpi4py"
    return check("world", OK, found), comm


def check_mpi():
    """The MPI library mpi4py runs on (the first line of its version)."""
    from mpi4py import MPI
    return check("mpi", OK, MPI.Get_library_version().strip("\x00 \n").splitlines()[0].strip())


def check_horovod(hvd):
    """How Horovod was built (controllers, GPU operations) and which controller runs."""
    built = {"MPI": hvd.mpi_built(), "gloo": hvd.gloo_built(), "NCCL": bool(hvd.nccl_built()),
             "CUDA": hvd.cuda_built(), "ROCm": hvd.rocm_built(), "CCL": hvd.ccl_built(), "DDL": hvd.ddl_built()}
    has = [k for k, v in built.items() if v]
    running = "MPI" if hvd.mpi_enabled() else "gloo" if hvd.gloo_enabled() else "none"
    found = (f"Horovod {_version('horovod')} built with {', '.join(has) or 'nothing'}; controller in use: {running}; "
             f"frontend {hvd.__name__}")
    if not built["MPI"]:
        return check("horovod", FAIL, found, "rebuild Horovod with MPI: HOROVOD_WITH_MPI=1 pip install "
                     "--no-cache-dir horovod (horovod_sparse exchanges over MPI)")
    return check("horovod", OK, found)


def check_cuda(hvd):
    """A GPU for torch, and Horovod built to reduce on it (no GPU is a warning only)."""
    try:
        import torch
    except ImportError:
        return check("cuda", WARN, "torch is not importable", "install torch to train with horovod_sparse.torch")
    if not torch.cuda.is_available():
        return check("cuda", WARN, f"no CUDA device for torch {torch.__version__}; Horovod built "
                     f"{'with' if hvd.cuda_built() else 'without'} CUDA",
                     "none on CPU; for GPUs install a CUDA build of torch and Horovod with "
                     "HOROVOD_GPU_OPERATIONS=NCCL")
    found = f"{torch.cuda.device_count()} CUDA device(s) ({torch.cuda.get_device_name(0)})"
    if not (hvd.cuda_built() or hvd.nccl_built()):
        return check("cuda", WARN, found + "; Horovod built without CUDA or NCCL: GPU tensors go through the host",
                     "rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL")
    from horovod_sparse.exchange.comm import cuda_payload_route
    return check("cuda", OK, found + f"; Horovod built with {'NCCL' if hvd.nccl_built() else 'CUDA'}; "
                 f"the exchanges' payloads go {cuda_payload_route()}")


def check_switches():
    """The package's environment switches (:mod:`horovod_sparse.switches`): each set to one of
    its choices (a job's first exchange would fail on every rank otherwise)."""
    from horovod_sparse import switches
    problem = switches.problem_here()
    if problem is not None:
        return check("switches", FAIL, problem, "unset it, or set it to one of its choices")
    return check("switches", OK, ", ".join(f"{v}={switches.read(v)}" for v in switches.CHOICES))


def check_versions(import_tensorflow=False):
    """Versions of what a job imports. TensorFlow is read from its metadata unless asked to
    import it (importing it takes seconds)."""
    parts = [f"Python {platform.python_version()}"]
    for name in ("numpy", "torch", "mpi4py", "horovod", "horovod_sparse"):
        parts.append(f"{name} {_version(name)}")
    tf = _version("tensorflow")
    if import_tensorflow and tf != "not installed":
        try:
            import horovod.tensorflow  # noqa: F401  (imports TensorFlow and Horovod's ops for it)
            import tensorflow
            tf = f"{tensorflow.__version__} (imported with horovod.tensorflow)"
        except Exception as e:  # noqa: BLE001  (any failure to import is the finding)
            return check("versions", FAIL, ", ".join(parts) + f", tensorflow {tf}: import failed: {e}",
                         "install a TensorFlow that Horovod was built against, or leave --tensorflow out "
                         "if the job does not use it")
    elif tf != "not installed":
        tf += " (not imported)"
    return check("versions", OK, ", ".join(parts + [f"tensorflow {tf}"]))


def check_cores(ranks, cores, yields, mpi_waits=True):
    """Ranks on this node against its cores: oversubscribed ranks must yield while they wait
    in MPI, or each busy-polls a core another rank needs. ``mpi_waits=False``: no rank waits in
    MPI (Horovod's Gloo controller, the exchanges over Horovod's collectives), so none busy-polls."""
    if not mpi_waits:
        setting = "no rank waits in MPI (Gloo controller, exchanges over Horovod's collectives)"
    else:
        setting = "mpi_yield_when_idle=1" if yields else "mpi_yield_when_idle not set"
    found = f"{ranks} rank(s) on this node, {cores} core(s) for them; {setting}"
    if ranks <= cores:
        return check("cores", OK, found)
    if yields or not mpi_waits:
        how = "they yield" if mpi_waits else "none busy-polls"
        return check("cores", WARN, found + f": the ranks share cores ({how}, so it runs, slower)",
                     "launch at most one rank per core for timings that mean something")
    return check("cores", FAIL, found + ": waiting ranks busy-poll the cores others need", YIELD_FIX)


def check_threads(ranks, cores):
    """The framework's threads per rank times the node's ranks, against its cores: more
    threads than cores contend, the step slows by a lot."""
    try:
        import torch
        threads = torch.get_num_threads()
    except ImportError:
        return check("threads", OK, "torch is not importable: not checked")
    found = f"torch uses {threads} thread(s) per rank x {ranks} rank(s) on {cores} core(s)"
    if threads * ranks <= max(cores, ranks):
        return check("threads", OK, found)
    per_rank = max(1, cores // ranks)
    return check("threads", WARN, found + ": threads contend for cores",
                 f"set OMP_NUM_THREADS={per_rank} (mpirun -x OMP_NUM_THREADS) or torch.set_num_threads({per_rank})")


def check_link(comm, repeats=5):
    """The link between the ranks: a buffer-based allreduce of a few bytes (its latency) and of
    a few MiB (its bandwidth), the slowest rank's median, as a per-rank bandwidth and latency
    (:meth:`~horovod_sparse.whatif.Network.from_allreduce`). Returns ``(check, Network or None)``."""
    from horovod_sparse.agreement import time_collective
    from horovod_sparse.schedule.cost import CostModel
    from horovod_sparse.whatif import Network
    size = comm.Get_size()
    if size < 2:
        return check("link", OK, "one rank: no link to measure"), None
    small, large = PROBE_BYTES[0], PROBE_BYTES[-1]
    for attempt in range(3):  # a busy core can stall the small probe past the large one: measure again, longer
        times = []
        for nbytes in PROBE_BYTES:
            send = np.ones(nbytes // 4, np.float32)
            recv = np.empty_like(send)
            times.append(time_collective(comm, lambda s=send, r=recv: comm.Allreduce(s, r), repeats << attempt))
        # two points, not a least-squares line: the large size would swallow the latency
        cost = CostModel(times[0], (times[-1] - times[0]) / (large - small))
        if cost.b > 0:  # the same on every rank: time_collective returns the slowest rank's median
            break
    if cost.b <= 0:
        return check("link", WARN, f"allreduce of {large >> 20} MiB took no longer than of {small} bytes "
                     f"({times[-1] * 1e3:.3f} ms): no bandwidth to fit", "run the doctor again on a quieter "
                     "machine"), None
    net = Network.from_allreduce(cost, size)
    return check("link", OK, f"allreduce over {size} ranks: {small} bytes {times[0] * 1e6:.0f} us, "
                 f"{large >> 20} MiB {times[-1] * 1e3:.2f} ms; per rank {net.gbps:.3g} Gbit/s, latency "
                 f"{net.latency_s * 1e6:.3g} us"), net


def check_whatif(net, workers, profile=DEFAULT_PROFILE):
    """What the what-if model predicts at the measured link for ``profile``: informative,
    never a failure (the profile is not the user's model unless they pass theirs)."""
    if net is None:
        return check("whatif", OK, "no measured link: nothing to predict")
    return check("whatif", OK, predict_line(net, workers, profile))


def predict_line(net, workers, profile):
    """One sentence: what the what-if model predicts at the measured link for ``profile``,
    and below which bandwidth each compressor would pay."""
    from horovod_sparse.whatif import load, recommend, sweep
    from horovod_sparse.whatif.advise import DEFAULT_MARGIN
    trace = load(profile)
    compressors = [c for c in trace.compressors if c != "dense"] or list(DEFAULT_COMPRESSORS)
    preds = sweep(trace, [workers], gbps=[net.gbps], compressors=compressors, latency_s=net.latency_s)
    rec = recommend(preds)[0]
    verdict = "dense is predicted fastest" if rec.choice == "none" else \
        f"{rec.choice} is predicted {rec.speedup:.2f}x faster than dense"
    pays = [f"{c} pays {_pays_below(trace, net.latency_s, workers, c, 1 + DEFAULT_MARGIN)}" for c in compressors]
    codec = "" if trace.compressors else ", codec cost not counted: the profile has none"
    return (f"{profile} ({trace.model}, {trace.device}{codec}) at {net.gbps:.3g} Gbit/s and {workers} ranks: "
            f"{verdict}; {', '.join(pays)} (pays: {DEFAULT_MARGIN:.0%} faster than dense)")


def _pays_below(trace, latency_s, workers, compressor, threshold, low=1e-3, high=1e4):
    """Where the predicted speed-up of ``compressor`` over dense crosses ``threshold``: it
    falls as the link gets faster, so a bisection on log(bandwidth) finds it."""
    from horovod_sparse.whatif import Network, predict

    def speedup(gbps):
        net = Network.from_gbps(gbps, latency_s)
        return predict(trace, net, workers, compressor="dense").step_s / \
            predict(trace, net, workers, compressor=compressor).step_s

    if speedup(low) < threshold:
        return "at no bandwidth"
    if speedup(high) >= threshold:
        return "at any bandwidth"
    for _ in range(30):
        mid = math.sqrt(low * high)
        low, high = (mid, high) if speedup(mid) >= threshold else (low, mid)
    return f"below {low:.3g} Gbit/s"


# ---------------------------------------------------------------------- node facts
def mpi_yields(environ=os.environ, files=MCA_PARAM_FILES):
    """Open MPI's ``mpi_yield_when_idle`` as the ranks see it: mpirun exports ``--mca`` and
    ``OMPI_MCA_*`` settings to them as ``OMPI_MCA_mpi_yield_when_idle``; else Open MPI's
    parameter files."""
    value = environ.get(YIELD_VARIABLE)
    for path in files:
        if value is not None:
            break
        value = _param_in_file(os.path.expanduser(path), "mpi_yield_when_idle")
    return value is not None and value.strip().lower() in ("1", "true", "yes", "on")


def _param_in_file(path, name):
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.split("#")[0].partition("=")
                if sep and key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def node_ranks_and_cores(comm):
    """``(ranks on this node, cores they may run on)``: the union of the node's ranks' CPU
    affinities (ranks bound to one core each still have the node's cores between them).
    Collective over ``comm``; over Horovod's collectives, the node's ranks are Horovod's
    ``local_size()`` and the cores the union over every rank's."""
    from mpi4py import MPI
    if not hasattr(comm, "Split_type"):  # Horovod's collectives: no shared-memory split
        from horovod_sparse import world
        return world.horovod_frontend().local_size(), _union_of_cores(comm)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_size(), _union_of_cores(node)
    finally:
        node.Free()


def _union_of_cores(comm):
    """How many cores the ranks of ``comm`` may run on between them (one Allreduce MAX)."""
    from mpi4py import MPI
    mine = np.zeros(os.cpu_count() or 1, np.uint8)
    mine[[c for c in os.sched_getaffinity(0) if c < mine.size]] = 1
    union = np.empty_like(mine)
    comm.Allreduce(mine, union, op=MPI.MAX)
    return int(union.sum())


# ------------------------------------------------------------------------ the report
def run(args, out=sys.stdout):
    """Run every check on this rank; rank 0 prints the report. Returns the exit code, the
    same on every rank: 1 if a check failed on any rank, else 0."""
    from horovod_sparse import world
    watchdog = _watchdog(args.timeout)
    try:
        hvd = world.horovod_frontend() or _init_horovod()
        world_check, comm = check_world()
        checks = [world_check, check_mpi(), check_horovod(hvd), check_cuda(hvd), check_switches(),
                  check_versions(args.tensorflow)]
        if comm is None:   # no collective: each rank reports what it found alone
            checks.append(check("link", WARN, "cores, threads and link not checked: they run collectives among "
                                "Horovod's ranks, which are not mapped", "see the fix of `world`"))
            rows = [checks]
        else:
            ranks, cores = node_ranks_and_cores(comm)
            cores = args.cores or cores
            mpi_waits = hvd.mpi_enabled() or getattr(comm, "point_to_point", True)
            core_check = check_cores(ranks, cores, mpi_yields(), mpi_waits)
            checks += [core_check, check_threads(ranks, cores)]
            if core_check["status"] == FAIL:  # comm.Allreduce would time the scheduler, not the link
                checks.append(check("link", WARN, "not measured: the ranks busy-poll shared cores",
                                    "see the fix of `cores`"))
            else:
                link_check, net = check_link(comm)
                checks += [link_check, check_whatif(net, comm.Get_size(), args.profile)]
            rows = _gather(comm, checks)
        code = 1 if any(c["status"] == FAIL for row in rows for c in row) else 0
        if hvd.rank() == 0:
            _print_report(rows, code, out, alone=comm is None)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({"ranks": len(rows), "exit": code, "checks": _merge(rows)}, f, indent=1)
        return code
    finally:
        watchdog.cancel()


def _init_horovod():
    import horovod.torch as hvd
    hvd.init()
    return hvd


def _gather(comm, checks):
    """Every rank's checks, in rank order (buffer-based: one Allgather of the lengths, one of
    the utf-8 bytes)."""
    from horovod_sparse.agreement import allgather_text
    return [json.loads(text) for text in allgather_text(comm, json.dumps(checks))]


def _merge(rows):
    """Per check, its distinct results with the ranks that found each."""
    merged = []
    for i, first in enumerate(rows[0]):
        results = {}
        for rank, row in enumerate(rows):
            key = (row[i]["status"], row[i]["found"], row[i]["fix"])
            results.setdefault(key, []).append(rank)
        for (status, found, fix), ranks in sorted(results.items(), key=lambda kv: -_SEVERITY[kv[0][0]]):
            merged.append({**check(first["check"], status, found, fix), "ranks": ranks})
    return merged


def _print_report(rows, code, out, alone):
    print("horovod-sparse doctor: this rank's checks (the ranks could not be gathered)" if alone else
          f"horovod-sparse doctor: {len(rows)} rank(s)", file=out)
    for c in _merge(rows):
        where = "" if len(c["ranks"]) == len(rows) else f"[rank {','.join(map(str, c['ranks']))}] "
        print(f"{c['status']:<4}  {c['check']:<8}  {where}{c['found']}", file=out)
        if c["status"] != OK and c["fix"]:
            print(f"{'':<4}  {'':<8}  fix: {c['fix']}", file=out)
    print("launch is sound" if code == 0 else "launch has a failing check: see the fix above", file=out)
    out.flush()


def _watchdog(seconds):
    """Ends this rank after ``seconds``: a peer that never joins a collective must not keep
    the others waiting forever."""
    def give_up():
        sys.stderr.write(f"horovod-sparse doctor: no result within {seconds:g} s (a rank never joined a "
                         "collective, or Horovod never initialised); check the launch command\n")
        sys.stderr.flush()
        os._exit(1)
    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    return timer


def _version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def add_arguments(parser, positive_int, positive_float):
    """The subcommand's flags (cli.py builds the parser)."""
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON (rank 0)")
    parser.add_argument("--tensorflow", action="store_true",
                        help="import TensorFlow and horovod.tensorflow (seconds); default: read its version only")
    parser.add_argument("--profile", default=DEFAULT_PROFILE, metavar="TRACE",
                        help=f"model profile the link's prediction is for (default {DEFAULT_PROFILE}; "
                        "a trace from `horovod-sparse profile` counts its codec costs too)")
    parser.add_argument("--cores", type=positive_int, metavar="N",
                        help="take the node's cores as N instead of the ranks' CPU affinity (for tests)")
    parser.add_argument("--timeout", type=positive_float, default=120.0, metavar="SECONDS",
                        help="end every rank after this long (default 120)")


def check_arguments(args, parser):
    """Refuse a profile that cannot be read before any rank starts Horovod (exit 2)."""
    from horovod_sparse.whatif import load
    try:
        load(args.profile)
    except (ValueError, OSError, KeyError) as e:
        parser.error(f"--profile: {e}")
    if args.json:
        folder = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(folder):
            parser.error(f"--json: no such folder {folder}")


__all__ = ["run", "add_arguments", "check_arguments", "check_world", "check_cores", "check_link", "check_whatif",
           "mpi_yields"]
