#!/usr/bin/env python3
"""Runs the whole test suite: single-process unit tests, then each parallel group under
``mpirun -np N`` for every N of the group (the way Horovod's own test/parallel runs); the
``gloo`` group under ``horovodrun --gloo -np N`` instead (one launch per module).

A failure on any rank fails the run. Every launch (the unit run too) has a wall-clock bound on
top of pytest-timeout's per-test bound, and ends with every process it started killed, however
far they went (scripts/bounded_run.py), so nothing hangs and nothing lingers. The last line is the total over
all runs and ranks: ``N passed, N failed, N skipped``.

Usage: python scripts/run_tests.py [--groups unit torch ...] [-k EXPR]
"""
import argparse
import os
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from bounded_run import TIMED_OUT, run_bounded

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# group -> the process counts it runs at; its tests are in tests/parallel/<group>.
PARALLEL_GROUPS = {
    "exchange": [1, 2, 3, 4, 5],
    "sparsify": [2, 3, 4],
    "quantize": [2, 3, 4],
    # The frontends over those exchanges: their tests run at fewer counts than the group is launched
    # at unless they mark other counts (each group's conftest; tests/parallel/world_sizes.py): torch at
    # 2 (3 for the modules whose subject changes with the count, 4 for the demo's convergence),
    # TensorFlow, whose tracing costs minutes a count, at 2 (3 for the modules that mark it).
    "torch": [2, 3, 4],
    "tensorflow": [2, 3],
    "worlds": [4],  # several Horovod jobs inside one mpirun: its scenarios name four processes
    # the exchange on recorded selections at high P only (a few short tests): at 8, past the small
    # counts above (at 16 too it took 31-43 s a run: 16 interpreters on 2 cores)
    "scale": [8],
}
#: groups that share one launch per process count (each launch runs those of them that include
#: that count): their tests take seconds, and a launch of its own cost each of them 3-12 s of start-up
SHARED_LAUNCH = ("exchange", "sparsify", "quantize")
UNIT_WALL_SECONDS = 1500  # about 6 min here
MPIRUN_WALL_SECONDS = 900
# groups launched by ``horovodrun --gloo`` instead of mpirun (Horovod's ranks are not one MPI job's:
# the exchanges run over Horovod's collectives), with their process counts and wall-clock bound (per launch)
# (3, an odd count: Horovod's collectives over Gloo take any count alike; at P = 2 too the two
# modules' launches took 73 s more, and mpirun's groups cover P = 2)
HOROVODRUN_GROUPS = {"gloo": [3]}
HOROVODRUN_WALL_SECONDS = 240

MPI_ENV = {
    # Open MPI refuses root without these; CI and the users' containers run as root.
    "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    # Horovod 0.28 needs Keras 2 (see horovod_sparse/tensorflow/keras_check.py).
    "TF_USE_LEGACY_KERAS": "1", "TF_CPP_MIN_LOG_LEVEL": "2",
    # Up to 5 ranks share 2 cores: one thread each keeps them from starving each other.
    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
    # Byte code written once, read by every later interpreter (empty: Python writes it, whatever the
    # machine's environment says): the suite starts hundreds, and each compiled the package and
    # pytest's rewritten test modules anew.
    "PYTHONDONTWRITEBYTECODE": "",
}


def run_unit(results, extra):
    junit = results / "unit.xml"
    # one worker per core (pytest-xdist); a module's tests stay on one worker, in order, as written,
    # and the modules go out in collection order (tests/unit/conftest.py puts the longest first);
    # a worker that dies ends the run (a replaced worker can leave xdist's loadfile scheduler waiting forever)
    cmd = [PYTHON, "-m", "pytest", "tests/unit", "-q", "-n", "auto", "--dist", "loadfile", "--no-loadscope-reorder",
           "--max-worker-restart", "0", f"--junitxml={junit}", *extra]
    return _launch(cmd, UNIT_WALL_SECONDS, "unit tests"), [junit]


def run_parallel(group, np_, results, extra):
    """One ``mpirun -np N`` of pytest over the group's tests; ``group`` may name several groups,
    joined by ``+`` (SHARED_LAUNCH)."""
    logdir = results / f"{group}-np{np_}"
    logdir.mkdir(parents=True)
    cmd = ["mpirun", "-np", str(np_), "--oversubscribe", "--bind-to", "none",
           # Ranks outnumber cores: yield instead of busy-polling while waiting in MPI.
           "--mca", "mpi_yield_when_idle", "1", "--mca", "btl_vader_single_copy_mechanism", "none",
           *[a for k in MPI_ENV for a in ("-x", k)],
           "tests/mpi_rank.sh", str(logdir),
           PYTHON, "-m", "pytest", *[f"tests/parallel/{g}" for g in group.split("+")], "-q", *extra]
    rc = _launch(cmd, MPIRUN_WALL_SECONDS, f"mpirun -np {np_} {group}")
    if rc != 0:
        for log in sorted(logdir.glob("rank*.log")):
            print(f"\n----- {group} np={np_} {log.name} (last 60 lines) -----")
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    return rc, sorted(logdir.glob("rank*.xml"))


def run_horovodrun(group, np_, results, extra):
    """The group under ``horovodrun --gloo -np N`` on this host, one launch per test module
    (Horovod runs one frontend per process: the PyTorch and TensorFlow modules apart), with the
    same environment and per-rank logs as :func:`run_parallel`; on timeout the whole process
    group is killed. The exit status: the first failing launch's, else 5 if no launch collected
    a test (a ``-k`` that matches none here), else 0."""
    codes, junit = [], []
    for module in sorted((ROOT / "tests" / "parallel" / group).glob("test_*.py")):
        logdir = results / f"{group}-np{np_}" / module.stem
        logdir.mkdir(parents=True)
        codes.append(_horovodrun(module.relative_to(ROOT), np_, logdir, extra))
        junit += sorted(logdir.glob("rank*.xml"))
    failed = [rc for rc in codes if rc not in (0, 5)]
    return (failed[0] if failed else 5 if codes and all(rc == 5 for rc in codes) else 0), junit


def _horovodrun(module, np_, logdir, extra):
    cmd = [str(Path(PYTHON).parent / "horovodrun"), "--gloo", "-np", str(np_), "-H", f"localhost:{np_}",
           "tests/mpi_rank.sh", str(logdir), PYTHON, "-m", "pytest", str(module), "-q", *extra]
    rc = _launch(cmd, HOROVODRUN_WALL_SECONDS, f"horovodrun -np {np_} {module}")
    if rc not in (0, 5):
        for log in sorted(logdir.glob("rank*.log")):
            print(f"\n----- {module} np={np_} {log.name} (last 60 lines) -----")
            print("\n".join(log.read_text(errors="replace").splitlines()[-60:]))
    return rc


def _launch(cmd, wall_s, label):
    """Run one launch for at most ``wall_s`` seconds, then end everything it started, wherever it
    went (scripts/bounded_run.py); returns its exit status, 124 when it ran out of time."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    start = time.monotonic()
    rc, _, left = run_bounded(cmd, wall_s, cwd=ROOT, env={**os.environ, **MPI_ENV})
    # each launch's wall time, so that a slow suite shows where its minutes go
    print(f"[{label}: exit {rc} after {time.monotonic() - start:.0f} s]", flush=True)
    if rc == TIMED_OUT:
        print(f"error: {label} exceeded {wall_s}s and was killed", flush=True)
    if left:
        print(f"warning: {label} left {len(left)} process(es) running; killed", flush=True)
    return rc


def outcomes(junit_files):
    """{test id: worst outcome over the given ranks' JUnit files}."""
    rank_order = {"passed": 0, "skipped": 1, "failed": 2}
    merged = {}
    for path in junit_files:
        try:
            cases = ET.parse(path).getroot().iter("testcase")
        except (ET.ParseError, FileNotFoundError):
            continue
        for case in cases:
            test_id = f"{case.get('classname')}::{case.get('name')}"
            kinds = {child.tag for child in case}
            outcome = "failed" if kinds & {"failure", "error"} else "skipped" if "skipped" in kinds else "passed"
            if rank_order[outcome] >= rank_order[merged.get(test_id, "passed")]:
                merged[test_id] = outcome
    return merged


def launches(groups):
    """[(group, process counts)] in the order asked, the groups of SHARED_LAUNCH asked together
    joined into one launch per count, where the first of them was asked (all three:
    ``exchange`` at 1, ``exchange+sparsify+quantize`` at 2, 3 and 4, ``exchange`` at 5);
    groups without tests are left out."""
    has_tests = [g for g in groups if g == "unit" or any((ROOT / "tests" / "parallel" / g).glob("test_*.py"))]
    shared = [g for g in has_tests if g in SHARED_LAUNCH]
    out, joined = [], False
    for group in has_tests:
        if group not in SHARED_LAUNCH:
            out.append((group, HOROVODRUN_GROUPS.get(group) or PARALLEL_GROUPS.get(group, [])))
        elif not joined:
            joined = True
            for np_ in sorted({n for g in shared for n in PARALLEL_GROUPS[g]}):
                out.append(("+".join(g for g in shared if np_ in PARALLEL_GROUPS[g]), [np_]))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", nargs="+", default=["unit", *PARALLEL_GROUPS, *HOROVODRUN_GROUPS],
                        choices=["unit", *PARALLEL_GROUPS, *HOROVODRUN_GROUPS])
    parser.add_argument("--np", type=int, nargs="+", help="only these process counts")
    parser.add_argument("-k", help="pytest -k expression")
    parser.add_argument("--results", type=Path, default=ROOT / "results" / "tests",
                        help="where the logs and JUnit files go (emptied first; default results/tests)")
    args = parser.parse_args()
    extra = ["-k", args.k] if args.k else []

    results = args.results.resolve()
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    totals = {"passed": 0, "failed": 0, "skipped": 0}
    failed_runs = []
    start = time.monotonic()
    for group, counts in launches(args.groups):
        launch = run_horovodrun if group in HOROVODRUN_GROUPS else run_parallel
        runs = [(None, *run_unit(results, extra))] if group == "unit" else [
            (np_, *launch(group, np_, results, extra)) for np_ in counts if not args.np or np_ in args.np]
        for np_, rc, junit in runs:
            label = group if np_ is None else f"{group} -np {np_}"
            merged = outcomes(junit)
            if rc not in (0, 5) and not merged:  # killed before any rank wrote its report
                merged = {f"{label}: whole run (exit {rc})": "failed"}
            for outcome in merged.values():
                totals[outcome] += 1
            # pytest exits 5 when it collected nothing (e.g. a -k that matches no test here).
            if rc not in (0, 5) or any(o == "failed" for o in merged.values()):
                failed_runs.append(f"{label} (exit {rc})")
                for test_id, outcome in merged.items():
                    if outcome == "failed":
                        print(f"FAILED {label}: {test_id}")
    print(f"\nwall time {time.monotonic() - start:.0f}s; per-rank logs and JUnit files in {results}")
    if failed_runs:
        print("failed runs: " + ", ".join(failed_runs))
    if sum(totals.values()) == 0:
        print("error: no test ran")
        return 1
    print(f"{totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
